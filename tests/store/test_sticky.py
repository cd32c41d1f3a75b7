"""StickyFirst: the store's placement wins when the replica can take it (pure, no I/O)."""

from __future__ import annotations

from types import MappingProxyType

from gateway.policy import PolicyContext, build_policy
from gateway.routing import RoutingSettings, build_router
from gateway.store import MemoryStore, PrefixPlacement
from gateway.store.sticky import StickyFirst
from gateway.types import ClusterView, EngineLoad, ReplicaId, ReplicaState, RouteRequest, SessionKey
from plugins.prefix_affinity import PrefixAffinity

IDS = [ReplicaId(f"r{i}") for i in range(4)]


def view(
    inflight: dict[ReplicaId, int] | None = None,
    unhealthy: ReplicaId | None = None,
    load: dict[ReplicaId, EngineLoad] | None = None,
) -> ClusterView:
    replicas = tuple(
        ReplicaState(
            id=r,
            url=f"http://{r}",
            healthy=r != unhealthy,
            load=(load or {}).get(r),
        )
        for r in IDS
    )
    return ClusterView(replicas, now=10.0, in_flight=MappingProxyType(dict(inflight or {})))


def router(load_factor: float | None = 1.25) -> StickyFirst:
    settings = RoutingSettings(policy="consistent_hash", filters=("healthy", "serves_model"))
    replicas = view().replicas
    return StickyFirst(
        build_router(settings, PolicyContext(replicas=replicas)),
        MemoryStore(),
        load_factor=load_factor,
    )


def request(sticky: ReplicaId | None) -> RouteRequest:
    return RouteRequest("q", "m", SessionKey("conv-7"), sticky_replica=sticky)


def other_than_owner(r: StickyFirst) -> ReplicaId:
    owner = r.choose(request(None), view()).ranked[0]
    return next(i for i in IDS if i != owner)


def test_without_placement_the_inner_choice_stands() -> None:
    r = router()
    inner = r.inner.choose(request(None), view())
    assert r.choose(request(None), view()) == inner


def test_sticky_replica_goes_first() -> None:
    r = router()
    sticky = other_than_owner(r)
    choice = r.choose(request(sticky), view())
    assert choice.ranked[0] == sticky and choice.reason == "sticky"
    assert sorted(choice.ranked) == sorted(IDS)  # failover order keeps everyone


def test_unhealthy_sticky_replica_is_not_honoured() -> None:
    r = router()
    sticky = other_than_owner(r)
    choice = r.choose(request(sticky), view(unhealthy=sticky))
    assert choice.ranked[0] != sticky and sticky not in choice.ranked


def test_overloaded_sticky_replica_is_left() -> None:
    r = router()
    sticky = other_than_owner(r)
    busy = view(inflight={sticky: 8})
    assert r.choose(request(sticky), busy).ranked[0] != sticky
    # Within the bound it still wins.
    assert r.choose(request(sticky), view(inflight={sticky: 1})).ranked[0] == sticky
    # And with the bound disabled, always.
    assert router(load_factor=None).choose(request(sticky), busy).ranked[0] == sticky


def test_saturated_engine_load_ends_stickiness() -> None:
    r = router()
    sticky = other_than_owner(r)
    full = EngineLoad(waiting=100, running=8, kv_usage=0.99, scraped_at=10.0)
    assert r.choose(request(sticky), view(load={sticky: full})).ranked[0] != sticky
    stale = EngineLoad(waiting=100, running=8, kv_usage=0.99, scraped_at=0.0)
    assert r.choose(request(sticky), view(load={sticky: stale})).ranked[0] == sticky


def test_remote_prefix_placements_feed_the_prefix_index() -> None:
    replicas = view().replicas
    policy = build_policy("prefix_affinity", None, PolicyContext(replicas=replicas))
    assert isinstance(policy, PrefixAffinity)
    r = StickyFirst(policy, MemoryStore())
    hashes = tuple(range(1000, 1032))
    probe = RouteRequest("q", "m", SessionKey("s"), prefix_hashes=hashes, prompt_tokens=32 * 16)
    assert policy.cached_tokens(probe, IDS[2]) == 0
    r.place_remote(PrefixPlacement("m", IDS[2], hashes[:16], block_tokens=16))
    assert policy.cached_tokens(probe, IDS[2]) == 16 * 16
    assert policy.cached_tokens(probe, IDS[1]) == 0
