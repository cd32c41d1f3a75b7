"""`TiersRuntime`: when a tier counts as saturated (healthy replicas serving its model, by
their served name), and what the sticky memory keeps (never a lower tier than it had)."""

from __future__ import annotations

from gateway.testing.views import ViewBuilder
from gateway.tiers.config import TiersSettings
from gateway.tiers.runtime import TiersRuntime, conversation_key, conversation_opening
from gateway.types import ClusterView, Endpoint
from tests.tiers.test_tiers_rules import chat, model


def spilling(view: ClusterView, served: dict[str, str] | None = None) -> TiersRuntime:
    m = model()
    small = m.tiers[0].model_copy(update={"spill_at_inflight": 2})
    settings = TiersSettings(models=(m.model_copy(update={"tiers": (small, *m.tiers[1:])}),))
    return TiersRuntime(settings, lambda: view, served.get if served else None)


def tier_of(rt: TiersRuntime) -> tuple[str, str]:
    d = rt.decide(rt.ladders["auto"], Endpoint.CHAT, chat(), [], priority_class="interactive")
    return d.tier, d.reason


def test_only_healthy_replicas_of_the_tiers_model_decide_saturation() -> None:
    base = ViewBuilder().replica("s0").replica("s1").replica("m0")
    base.models("s0", "small").models("s1", "small").models("m0", "medium")
    # Every healthy small replica at the limit: interactive traffic spills up.
    assert tier_of(spilling(base.inflight({"s0": 2, "s1": 5}).build())) == ("m", "spill")
    # One below the limit: it stays.
    assert tier_of(spilling(base.inflight({"s0": 2, "s1": 1}).build())) == ("s", "default")
    # An unhealthy replica's spare room is no room: the healthy one is full.
    half = ViewBuilder().replica("s0").replica("s1").models("s0", "small").models("s1", "small")
    assert tier_of(spilling(half.unhealthy("s1").inflight({"s0": 2}).build())) == ("m", "spill")
    # No healthy replica at all serves the tier: that is not saturation, nothing to spill from
    # (admission and the router answer for an empty pool).
    none = ViewBuilder().replica("m0").models("m0", "medium").build()
    assert tier_of(spilling(none)) == ("s", "default")


def test_saturation_reads_the_tiers_model_by_its_served_name() -> None:
    view = ViewBuilder().replica("s0").models("s0", "org/small-v2").inflight({"s0": 3}).build()
    # Without the mapping nothing serves "small": no spill. With it, s0 is full.
    assert tier_of(spilling(view)) == ("s", "default")
    assert tier_of(spilling(view, {"small": "org/small-v2"})) == ("m", "spill")


def test_a_conversation_never_drops_back_to_a_lower_tier() -> None:
    rt = spilling(ViewBuilder().replica("s0").models("s0", "small").build())
    ladder = rt.ladders["auto"]
    high = rt.decide(ladder, Endpoint.CHAT, chat(), [(b"x-kvgate-tier", b"l")], session="c1")
    assert (high.tier, high.reason) == ("l", "hint")
    rt.served(high, None, final=True)
    low = ladder.decision(0, "default", None, high.sticky_key)
    rt.remember(low)  # a later answer from a lower tier does not lower the memory
    again = rt.decide(ladder, Endpoint.CHAT, chat(), [], session="c1")
    assert (again.tier, again.reason) == ("l", "sticky")
    # A decision with no conversation key is not remembered at all.
    rt.remember(ladder.decision(1, "default", None, None))
    assert rt.decide(ladder, Endpoint.CHAT, chat(), [], session="c2").reason == "default"


def test_the_opening_is_everything_up_to_the_first_user_turn() -> None:
    sys_msg = {"role": "system", "content": "be brief"}
    user = {"role": "user", "content": "q"}
    assert conversation_opening({"messages": [sys_msg, user, {"role": "user"}]}) == [sys_msg, user]
    for body in ({"messages": []}, {"messages": "text"}, {"messages": [sys_msg]}, {}):
        assert conversation_opening(body) is None
        assert conversation_key("auto", body, None) is None
    # The public name is part of the key: one conversation on two tiered names is two.
    body = {"messages": [user]}
    assert conversation_key("auto", body, None) != conversation_key("other", body, None)
