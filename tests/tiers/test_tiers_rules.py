"""Entry-tier rules, stickiness and spill-over: the pure ladder, and the runtime's memory."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gateway.hooks import Tiers
from gateway.testing.views import ViewBuilder
from gateway.tiers.config import TieredModel, TiersSettings
from gateway.tiers.ladder import Ladder, TierInput, tier_input
from gateway.tiers.runtime import TiersRuntime, conversation_key
from gateway.types import ClusterView, Endpoint


def model(**extra: Any) -> TieredModel:
    raw: dict[str, Any] = {
        "name": "auto",
        "tiers": [
            {"name": "s", "model": "small"},
            {"name": "m", "model": "medium"},
            {"name": "l", "model": "large"},
        ],
        "rules": [
            {"tier": "l", "endpoints": ["embeddings"]},
            {"tier": "m", "min_max_tokens": 1000},
            {"tier": "l", "response_format": True, "priority_classes": ["interactive"]},
            {"tier": "m", "api_keys": ["ci"]},
            {"tier": "l", "min_score": 0.9},
        ],
        "classifier": {"name": "features"},
        **extra,
    }
    return TieredModel.model_validate(raw)


def chat(**body: Any) -> dict[str, Any]:
    return {"model": "auto", "messages": [{"role": "user", "content": "hi"}], **body}


@pytest.mark.parametrize(
    ("endpoint", "body", "kw", "score", "expect"),
    [
        (Endpoint.CHAT, chat(), {}, 0.1, ("s", "default")),
        (Endpoint.EMBEDDINGS, {"model": "auto", "input": "x"}, {}, 0.1, ("l", "rule:0")),
        (Endpoint.CHAT, chat(max_tokens=4000), {}, 0.1, ("m", "rule:1")),
        (Endpoint.CHAT, chat(max_tokens=999), {}, 0.1, ("s", "default")),
        (
            Endpoint.CHAT,
            chat(response_format={"type": "json_object"}),
            {"priority_class": "interactive"},
            0.1,
            ("l", "rule:2"),
        ),
        (Endpoint.CHAT, chat(response_format={"type": "json_object"}), {}, 0.1, ("s", "default")),
        (Endpoint.CHAT, chat(), {"api_key": "ci"}, 0.1, ("m", "rule:3")),
        (Endpoint.CHAT, chat(), {}, 0.95, ("l", "rule:4")),
        (Endpoint.CHAT, chat(), {"hint": "m"}, 0.95, ("m", "hint")),
        (Endpoint.CHAT, chat(), {"hint": "nonsense"}, 0.1, ("s", "default")),
        (Endpoint.CHAT, chat(max_tokens=4000), {"remembered": 0}, 0.1, ("s", "sticky")),
    ],
)
def test_first_matching_rule_wins(
    endpoint: Endpoint, body: dict[str, Any], kw: dict[str, Any], score: float, expect: Any
) -> None:
    ladder = Ladder(model())
    decision = ladder.choose(tier_input(endpoint, body, **kw), score)
    assert (decision.tier, decision.reason) == expect
    assert decision.model == {"s": "small", "m": "medium", "l": "large"}[decision.tier]


def test_escalation_walks_up_and_stops_at_the_top() -> None:
    ladder = Ladder(model())
    first = ladder.choose(tier_input(Endpoint.CHAT, chat()), 0.0)
    second = ladder.escalated(first, "length")
    assert second is not None and (second.tier, second.reason) == ("m", "escalated:length")
    third = ladder.escalated(second, "json")
    assert third is not None and third.tier == "l"
    assert ladder.escalated(third, "json") is None


def test_config_errors_name_the_problem() -> None:
    with pytest.raises(ValidationError, match="not one of"):
        model(rules=[{"tier": "xl"}])
    with pytest.raises(ValidationError, match="take_over"):
        TieredModel.model_validate(
            {
                "name": "large",
                "tiers": [{"name": "s", "model": "small"}, {"name": "l", "model": "large"}],
            }
        )
    with pytest.raises(ValidationError, match="no classifier"):
        model(classifier=None)
    with pytest.raises(ValidationError, match="at least 2"):
        TieredModel.model_validate({"name": "auto", "tiers": [{"name": "s", "model": "small"}]})
    taken = TieredModel.model_validate(
        {
            "name": "large",
            "take_over": True,
            "tiers": [{"name": "s", "model": "small"}, {"name": "l", "model": "large"}],
        }
    )
    assert taken.name == "large"


def view_with(inflight: dict[str, int]) -> ClusterView:
    builder = ViewBuilder().replica("s0").replica("s1").replica("l0")
    builder.models("s0", "small").models("s1", "small").models("l0", "large")
    return builder.inflight(inflight).build()


def runtime(view: ClusterView, **small: Any) -> TiersRuntime:
    m = model()
    tiers = [m.tiers[0].model_copy(update=small), *m.tiers[1:]]
    settings = TiersSettings(models=(m.model_copy(update={"tiers": tuple(tiers)}),))
    return TiersRuntime(settings, lambda: view)


def test_a_saturated_small_tier_spills_interactive_traffic_but_not_batch() -> None:
    busy = view_with({"s0": 4, "s1": 4})
    rt = runtime(busy, spill_at_inflight=4)
    ladder = rt.ladders["auto"]
    body = chat(messages=[{"role": "user", "content": "a"}])
    spilled = rt.decide(ladder, Endpoint.CHAT, body, [], priority_class="interactive")
    assert (spilled.tier, spilled.reason) == ("m", "spill")
    waits = rt.decide(ladder, Endpoint.CHAT, body, [], priority_class="batch")
    assert (waits.tier, waits.reason) == ("s", "default")
    one_free = runtime(view_with({"s0": 4, "s1": 3}), spill_at_inflight=4)
    decision = one_free.decide(one_free.ladders["auto"], Endpoint.CHAT, body, [])
    assert decision.tier == "s"
    never = runtime(busy)  # no spill_at_inflight: never spills
    assert never.decide(never.ladders["auto"], Endpoint.CHAT, body, []).tier == "s"


def test_the_runtime_remembers_a_conversation_and_its_escalation() -> None:
    rt = runtime(view_with({}))
    ladder = rt.ladders["auto"]
    opening = [{"role": "system", "content": "sys"}, {"role": "user", "content": "first"}]
    first = rt.decide(ladder, Endpoint.CHAT, chat(messages=opening), [])
    assert first.reason == "default" and first.sticky_key is not None
    rt.served(first, {"prompt_tokens": 10, "completion_tokens": 5}, final=True)
    later = opening + [
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "second"},
    ]
    again = rt.decide(ladder, Endpoint.CHAT, chat(messages=later, max_tokens=5000), [])
    assert (again.tier, again.reason) == ("s", "sticky")
    up = rt.escalate(again, "length")
    assert up is not None
    rt.served(up, {"prompt_tokens": 10, "completion_tokens": 5}, final=True)
    third = rt.decide(ladder, Endpoint.CHAT, chat(messages=later), [])
    assert (third.tier, third.reason) == ("m", "sticky")
    # the hint header is read by its configured name
    hinted = rt.decide(ladder, Endpoint.CHAT, chat(messages=later), [(b"x-kvgate-tier", b"l")])
    assert (hinted.tier, hinted.reason) == ("l", "hint")
    assert rt.ledger.escalations[("auto", "s", "length")] == 1
    assert rt.ledger.requests == {("auto", "s"): 1, ("auto", "m"): 1}


def test_conversation_keys() -> None:
    a = [{"role": "user", "content": "q"}]
    b = [*a, {"role": "assistant", "content": "r"}, {"role": "user", "content": "q2"}]
    assert conversation_key("auto", {"messages": a}, None) == conversation_key(
        "auto", {"messages": b}, None
    )
    assert conversation_key("auto", {"messages": a}, None) != conversation_key(
        "auto", {"messages": [{"role": "user", "content": "other"}]}, None
    )
    assert conversation_key("auto", {"prompt": "x"}, None) is None
    assert conversation_key("auto", {"prompt": "x"}, "s1") == "auto|s:s1"


def test_lru_bound() -> None:
    m = model()
    rt = TiersRuntime(TiersSettings(models=(m,), sticky_sessions=2), lambda: view_with({}))
    ladder = rt.ladders["auto"]
    for session in ("a", "b", "c"):
        d = rt.decide(ladder, Endpoint.CHAT, chat(), [], session=session)
        rt.served(d, None, final=True)
    assert rt.decide(ladder, Endpoint.CHAT, chat(), [], session="a").reason == "default"
    assert rt.decide(ladder, Endpoint.CHAT, chat(), [], session="c").reason == "sticky"


def test_tier_input_reads_no_more_than_it_needs() -> None:
    x = tier_input(Endpoint.CHAT, chat(tools=[{"type": "function"}], max_completion_tokens=7))
    assert x == TierInput(Endpoint.CHAT, 0, 7, True, False, None, None, "default")


def test_entry_is_the_request_paths_one_question() -> None:
    """`entry` (the `gateway.hooks.Tiers` inbound asks): a tiered name's decision, as
    `decide` makes it, and None for a name no ladder serves."""
    rt = runtime(view_with({}))
    body = chat(messages=[{"role": "user", "content": "a"}])
    tiers: Tiers = rt  # what state.tiers is typed as
    entered = tiers.entry("auto", Endpoint.CHAT, body, [])
    assert entered == rt.decide(rt.ladders["auto"], Endpoint.CHAT, body, [])
    assert tiers.entry("small", Endpoint.CHAT, body, []) is None
