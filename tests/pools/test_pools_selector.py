from __future__ import annotations

from collections import Counter
from types import MappingProxyType
from typing import Any

import pytest
from pools_helpers import (
    FP4_MODEL,
    cluster,
    replica,
    request,
    ring_factory,
    settings,
    two_pools,
)

from gateway.policy import ObservesPlacement, Policy, ReactsToMembership
from gateway.pools.controller import WeightSnapshot
from gateway.pools.selector import PoolSelector, session_point, split_by_weight
from gateway.types import ClusterView, ReplicaId

BUSY = {"running": 10.0, "waiting": 30.0}  # 4x the 10 slots: far past saturation


def selector(
    weights: dict[str, float] | None = None, view: ClusterView | None = None, **overrides: Any
) -> tuple[PoolSelector, list[WeightSnapshot]]:
    snap = [WeightSnapshot(MappingProxyType(weights or {"h200": 0.5, "domestic": 0.5}))]
    sel = PoolSelector(
        ring_factory, settings(**overrides), lambda: snap[0], (view or two_pools()).replicas
    )
    return sel, snap


def pool_of(view: ClusterView, rid: ReplicaId | None) -> str | None:
    assert rid is not None
    return view.by_id[rid].pool


def test_selector_is_a_policy_with_the_optional_abilities() -> None:
    sel, _ = selector()
    assert isinstance(sel, Policy)
    assert isinstance(sel, ObservesPlacement) and isinstance(sel, ReactsToMembership)


def test_capability_constraint_holds_even_when_the_capable_pool_is_overloaded() -> None:
    view = two_pools(**{f"h200-{i}": BUSY for i in range(3)})
    sel, _ = selector({"h200": 0.0, "domestic": 1.0}, view)
    for i in range(200):
        choice = sel.choose(request(f"s{i}", "deepseek"), view)
        assert choice.ranked, choice
        assert {pool_of(view, r) for r in choice.ranked} == {"h200"}, choice


def test_no_replica_outside_the_allowed_pools_even_as_failover_tail() -> None:
    view = cluster(replica("h", "h200"), replica("d", "domestic"), replica("loose", None))
    sel, _ = selector(view=view)
    ranked = sel.choose(request("x", FP4_MODEL), view).ranked
    assert ranked == ("h",)


def test_alias_is_resolved_before_the_inner_policy_sees_the_model() -> None:
    view = two_pools()
    for rid in ("h200-0", "h200-1", "h200-2"):
        assert view.by_id[ReplicaId(rid)].serves(FP4_MODEL)
    only_served = cluster(*(replica(r.id, r.pool, models=(FP4_MODEL,)) for r in view.replicas))
    sel, _ = selector(view=only_served)
    choice = sel.choose(request("a", "deepseek"), only_served)
    assert choice.first is not None and pool_of(only_served, choice.first) == "h200"


def test_weights_split_sessions_deterministically_and_in_proportion() -> None:
    view = two_pools()
    sel, _ = selector({"h200": 0.2, "domestic": 0.8}, view)
    picks = {f"s{i}": pool_of(view, sel.choose(request(f"s{i}"), view).first) for i in range(2000)}
    share = Counter(picks.values())
    assert 0.75 < share["domestic"] / 2000 < 0.85
    again = PoolSelector(
        ring_factory,
        settings(),
        lambda: WeightSnapshot(MappingProxyType({"h200": 0.2, "domestic": 0.8})),
        view.replicas,
    )
    assert all(pool_of(view, again.choose(request(s), view).first) == p for s, p in picks.items())


def test_failover_tail_holds_the_other_pool_after_the_chosen_one() -> None:
    view = two_pools()
    sel, _ = selector({"h200": 0.0, "domestic": 1.0}, view)
    ranked = sel.choose(request("t"), view).ranked
    pools = [pool_of(view, r) for r in ranked]
    assert pools[:3] == ["domestic"] * 3 and pools[3:] == ["h200"] * 3


def test_tenant_rule_beats_class_rule_beats_weights() -> None:
    rules = [
        {"priority_class": "interactive", "prefer": ["h200"]},
        {"tenant": "acme", "prefer": ["domestic"]},
        {"priority_class": "batch", "prefer": ["domestic"]},
    ]
    view = two_pools()
    sel, _ = selector({"h200": 0.0, "domestic": 1.0}, view, rules=rules)
    assert (
        pool_of(view, sel.choose(request("a", priority_class="interactive"), view).first) == "h200"
    )
    acme = request("b", priority_class="interactive", tenant="acme")
    choice = sel.choose(acme, view)
    assert pool_of(view, choice.first) == "domestic" and choice.reason.startswith(
        "domestic:rule_tenant:"
    )
    assert pool_of(view, sel.choose(request("c", priority_class="batch"), view).first) == "domestic"


def test_rule_skips_a_saturated_preferred_pool() -> None:
    view = two_pools(**{f"h200-{i}": BUSY for i in range(3)})
    sel, _ = selector(
        {"h200": 1.0, "domestic": 0.0},
        view,
        rules=[{"priority_class": "interactive", "prefer": ["h200"]}],
    )
    choice = sel.choose(request("a", priority_class="interactive"), view)
    assert pool_of(view, choice.first) == "domestic"


def test_placed_session_stays_put_when_weights_move_until_its_pool_saturates() -> None:
    view = two_pools()
    sel, snap = selector({"h200": 1.0, "domestic": 0.0}, view)
    first = sel.choose(request("conv"), view).first
    assert pool_of(view, first) == "h200"
    assert first is not None
    sel.placed(request("conv"), first)
    snap[0] = WeightSnapshot(MappingProxyType({"h200": 0.0, "domestic": 1.0}), version=1)
    assert sel.choose(request("conv"), view).first == first
    assert pool_of(view, sel.choose(request("new"), view).first) == "domestic"
    hot = two_pools(**{f"h200-{i}": BUSY for i in range(3)})
    moved = sel.choose(request("conv"), hot)
    assert pool_of(hot, moved.first) == "domestic"
    assert moved.reason.startswith("domestic:weights_home_saturated:")


def test_idle_session_follows_the_weights_active_one_stays() -> None:
    view = two_pools()
    now = [100.0]
    snap = [WeightSnapshot(MappingProxyType({"h200": 1.0, "domestic": 0.0}))]
    sel = PoolSelector(
        ring_factory,
        settings(session_idle_release_s=30.0),
        lambda: snap[0],
        view.replicas,
        clock=lambda: now[0],
    )
    for key in ("idle", "active"):
        first = sel.choose(request(key), view).first
        assert first is not None and pool_of(view, first) == "h200"
        sel.placed(request(key), first)
    snap[0] = WeightSnapshot(MappingProxyType({"h200": 0.0, "domestic": 1.0}), version=1)
    now[0] = 125.0
    active = sel.choose(request("active"), view)
    assert pool_of(view, active.first) == "h200"  # 25 s idle: still sticky
    assert active.first is not None
    sel.placed(request("active"), active.first)
    now[0] = 131.0
    moved = sel.choose(request("idle"), view)  # 31 s idle: follows the weights
    assert pool_of(view, moved.first) == "domestic"
    assert moved.reason.startswith("domestic:weights_idle_release:")
    assert pool_of(view, sel.choose(request("active"), view).first) == "h200"  # 6 s idle
    assert moved.first is not None
    sel.placed(request("idle"), moved.first)
    now[0] = 500.0  # idle again, but the weights still pick its new pool: it stays
    assert sel.choose(request("idle"), view).reason.startswith("domestic:session:")


def test_idle_release_is_off_by_default() -> None:
    view = two_pools()
    now = [0.0]
    snap = [WeightSnapshot(MappingProxyType({"h200": 1.0, "domestic": 0.0}))]
    sel = PoolSelector(
        ring_factory, settings(), lambda: snap[0], view.replicas, clock=lambda: now[0]
    )
    first = sel.choose(request("conv"), view).first
    assert first is not None
    sel.placed(request("conv"), first)
    snap[0] = WeightSnapshot(MappingProxyType({"h200": 0.0, "domestic": 1.0}), version=1)
    now[0] = 1e6
    assert sel.choose(request("conv"), view).first == first


def test_session_store_placement_counts_as_home() -> None:
    view = two_pools()
    sel, _ = selector({"h200": 0.0, "domestic": 1.0}, view)
    req = request("from-another-gateway", sticky_replica=ReplicaId("h200-1"))
    assert pool_of(view, sel.choose(req, view).first) == "h200"


def test_every_pool_saturated_picks_the_least_utilised() -> None:
    view = two_pools(
        **{f"h200-{i}": BUSY for i in range(3)},
        **{f"domestic-{i}": {"running": 10.0, "waiting": 5.0} for i in range(3)},
    )
    sel, _ = selector({"h200": 1.0, "domestic": 0.0}, view)
    choice = sel.choose(request("z"), view)
    assert pool_of(view, choice.first) == "domestic" and ":all_saturated:" in choice.reason


def test_stale_scrape_still_sees_gateway_in_flight_load() -> None:
    base = two_pools()
    stale = ClusterView(
        replicas=base.replicas, now=1000.0, in_flight={ReplicaId(f"h200-{i}"): 12 for i in range(3)}
    )
    sel, _ = selector({"h200": 1.0, "domestic": 0.0}, stale)
    assert pool_of(stale, sel.choose(request("q"), stale).first) == "domestic"


def test_inner_policy_is_one_instance_per_pool_and_keeps_sessions_on_a_replica() -> None:
    view = two_pools()
    sel, _ = selector(view=view)
    firsts = {sel.choose(request("same"), view).first for _ in range(20)}
    assert len(firsts) == 1


@pytest.mark.parametrize("point", [0.0, 0.19999, 0.2, 0.99999])
def test_split_by_weight_edges(point: float) -> None:
    expected = "a" if point < 0.2 else "b"
    assert split_by_weight(point, [("a", 1.0), ("b", 4.0)]) == expected
    assert split_by_weight(point, [("a", 0.0), ("b", 0.0)]) == ("a" if point < 0.5 else "b")


def test_session_point_is_stable_and_in_range() -> None:
    assert session_point("abc") == session_point("abc")
    assert all(0.0 <= session_point(str(i)) < 1.0 for i in range(1000))


def _busy_view(busy: dict[str, int]) -> ClusterView:
    base = two_pools()
    return ClusterView(
        replicas=base.replicas, now=base.now, in_flight={ReplicaId(k): v for k, v in busy.items()}
    )


def test_new_session_spills_only_when_every_replica_of_its_pool_is_busy() -> None:
    sel, _ = selector({"h200": 0.0, "domestic": 1.0}, spill_new_sessions_at=1)
    # One domestic replica is free: the new session stays in its pool, on the free replica.
    view = _busy_view({"domestic-0": 1, "domestic-1": 2})
    choice = sel.choose(request("new-a"), view)
    assert choice.first == ReplicaId("domestic-2") and ":weights:" in choice.reason
    # Every domestic replica busy, an h200 one idle: the first turn goes there.
    view = _busy_view({"domestic-0": 1, "domestic-1": 1, "domestic-2": 3, "h200-0": 1})
    choice = sel.choose(request("new-b"), view)
    assert choice.first in {ReplicaId("h200-1"), ReplicaId("h200-2")}
    assert choice.reason.startswith("h200:spill:")
    # Nowhere idle: the weights decide, as without the option.
    view = _busy_view({f"{p}-{i}": 1 for p in ("h200", "domestic") for i in range(3)})
    assert sel.choose(request("new-c"), view).reason.startswith("domestic:weights:")


def test_placed_sessions_never_spill_and_spill_is_off_by_default() -> None:
    busy = _busy_view({"domestic-0": 1, "domestic-1": 1, "domestic-2": 1})
    sel, _ = selector({"h200": 0.0, "domestic": 1.0}, spill_new_sessions_at=1)
    home = sel.choose(request("old"), two_pools()).first
    assert home is not None and pool_of(busy, home) == "domestic"
    sel.placed(request("old"), home)
    assert sel.choose(request("old"), busy).first == home  # its prefix lives there
    off, _ = selector({"h200": 0.0, "domestic": 1.0})
    assert off.choose(request("new"), busy).reason.startswith("domestic:weights:")


def test_warm_move_names_an_idle_replica_of_the_pool_the_weights_now_give() -> None:
    view = two_pools()
    sel, snap = selector({"h200": 1.0, "domestic": 0.0}, view)
    conv = request("conv")
    home = sel.choose(conv, view).first
    assert home is not None and pool_of(view, home) == "h200"
    sel.placed(conv, home)
    # The weights still give the session its pool: nothing to move.
    assert sel.warm_move(conv, home, view) is None
    snap[0] = WeightSnapshot(MappingProxyType({"h200": 0.0, "domestic": 1.0}), version=1)
    move = sel.warm_move(conv, home, view)
    assert move is not None and move[0] == "domestic"
    target = move[1]
    assert target is not None and pool_of(view, target) == "domestic"
    # The inner policy's first pick, unless it is busy: then the next idle one, else none.
    busy_first = cluster(*view.replicas, in_flight={target: 1})
    second = sel.warm_move(conv, home, busy_first)
    assert second is not None and second[1] not in (None, target)
    assert pool_of(view, second[1]) == "domestic"
    all_busy = cluster(*view.replicas, in_flight={f"domestic-{i}": 1 for i in range(3)})
    assert sel.warm_move(conv, home, all_busy) == ("domestic", None)
    # Warming does not move the session by itself: `placed` on the target does.
    assert sel.choose(conv, view).first == home
    sel.placed(conv, target)
    assert pool_of(view, sel.choose(conv, view).first) == "domestic"
    # A late look at the old turn finds the session gone: nothing to warm.
    assert sel.warm_move(conv, home, view) is None


def test_a_move_onto_the_pricier_pool_buys_latency_only_while_its_own_pool_is_cool() -> None:
    sel, snap = selector({"h200": 1.0, "domestic": 0.0})
    on_domestic, on_h200 = ReplicaId("domestic-0"), ReplicaId("h200-0")
    weights = MappingProxyType({"h200": 1.0, "domestic": 0.0})
    # No utilisation sample yet: nothing speaks against the move.
    assert not sel.move_buys_latency_only(on_domestic, "h200")

    def sampled(domestic: float) -> WeightSnapshot:
        return WeightSnapshot(weights, MappingProxyType({"h200": 0.1, "domestic": domestic}))

    high = settings().controller.high_watermark
    snap[0] = sampled(high - 0.01)
    assert sel.move_buys_latency_only(on_domestic, "h200")
    snap[0] = sampled(high)  # under pressure: the move relieves the session's pool
    assert not sel.move_buys_latency_only(on_domestic, "h200")
    # Onto the cheaper pool, or within a price, a move always pays.
    snap[0] = sampled(0.0)
    assert not sel.move_buys_latency_only(on_h200, "domestic")
    assert not sel.move_buys_latency_only(on_domestic, "domestic")
    assert not sel.move_buys_latency_only(ReplicaId("nowhere"), "h200")


def test_warm_move_leaves_rule_placed_and_unservable_requests_alone() -> None:
    view = two_pools(**{f"domestic-{i}": BUSY for i in range(3)})
    sel, _ = selector(
        {"h200": 0.0, "domestic": 1.0},
        view,
        rules=[{"priority_class": "interactive", "prefer": ["h200"]}],
    )
    home = ReplicaId("h200-0")
    # A rule places the class: the weights do not move it.
    interactive = request("a", priority_class="interactive")
    assert sel.warm_move(interactive, home, two_pools()) is None
    # The weighted pool is saturated: there is nowhere better to warm.
    assert sel.warm_move(request("b"), home, view) is None
    # Only h200 has fp4: the capability constraint holds for warm-ups too.
    assert sel.warm_move(request("c", FP4_MODEL), home, two_pools()) is None
    assert sel.warm_move(request("d", "no-such-model"), home, two_pools()) is None


def test_new_sessions_start_on_the_configured_pool_unless_it_is_saturated() -> None:
    view = two_pools()
    sel, _ = selector(
        {"h200": 0.0, "domestic": 1.0},
        view,
        new_sessions_pool="h200",
        rules=[{"priority_class": "batch", "prefer": ["domestic"]}],
    )
    first = sel.choose(request("conv"), view)
    assert pool_of(view, first.first) == "h200" and first.reason.startswith("h200:new_session:")
    assert first.first is not None
    sel.placed(request("conv"), first.first)
    # Only the first turn: a placed session is at home wherever it lives now.
    assert sel.choose(request("conv"), view).reason.startswith("h200:session:")
    # A rule still wins, and a saturated start pool is skipped.
    assert pool_of(view, sel.choose(request("b", priority_class="batch"), view).first) == "domestic"
    hot = two_pools(**{f"h200-{i}": BUSY for i in range(3)})
    assert pool_of(hot, sel.choose(request("other"), hot).first) == "domestic"


def test_new_sessions_pool_must_be_a_configured_pool() -> None:
    with pytest.raises(ValueError, match="new_sessions_pool: unknown pool 'h100'"):
        settings(new_sessions_pool="h100")


def test_selector_estimates_cached_tokens_only_when_its_pools_policy_does() -> None:
    """Admission, engine priority and PD read the selector's estimate: it is the replica's
    pool's own policy's, and absent (not zero) when that policy keeps no prefix index."""
    from gateway.policy import EstimatesCachedTokens, PolicyContext
    from plugins.lineage import Lineage, LineageConfig

    def lineage_factory(replicas: tuple[Any, ...]) -> Policy:
        return Lineage(LineageConfig(), PolicyContext(replicas=replicas))

    view = two_pools()
    snap = WeightSnapshot(MappingProxyType({"h200": 0.5, "domestic": 0.5}))
    sel = PoolSelector(lineage_factory, settings(), lambda: snap, view.replicas)
    assert isinstance(sel, EstimatesCachedTokens)
    hashes = tuple(range(1, 9))
    first = request("conv", prefix_hashes=hashes, block_tokens=512, prompt_tokens=8 * 512)
    rid = sel.choose(first, view).first
    assert rid is not None
    sel.dispatched(first, rid)
    sel.placed(first, rid)
    other = next(r.id for r in view.replicas if r.id != rid)
    assert sel.cached_tokens(first, rid) == 8 * 512
    assert sel.cached_tokens(first, other) == 0
    ring, _ = selector()
    assert not isinstance(ring, EstimatesCachedTokens)
