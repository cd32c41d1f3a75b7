from __future__ import annotations

from collections import Counter

import pytest

from gateway.errors import ConfigError
from gateway.policy import PolicyContext, ReactsToMembership, build_policy
from gateway.testing.views import ViewBuilder, make_request
from gateway.types import ReplicaId
from plugins.consistent_hash import ConsistentHash, ConsistentHashConfig


def policy(**config: object) -> ConsistentHash:
    return ConsistentHash(ConsistentHashConfig(**config), PolicyContext())  # type: ignore[arg-type]


def test_same_session_same_replica_and_sessions_spread() -> None:
    view = ViewBuilder().replicas(4).build()
    p = policy()
    assert len({p.choose(make_request("s1"), view).first for _ in range(20)}) == 1
    spread = Counter(p.choose(make_request(f"s{i}"), view).first for i in range(4000))
    assert len(spread) == 4 and min(spread.values()) > 600
    choice = p.choose(make_request("s1"), view)
    assert choice.reason == "ring" and choice.policy == "consistent_hash"
    assert sorted(choice.ranked) == ["r0", "r1", "r2", "r3"]


def test_down_replica_fails_over_and_session_comes_back() -> None:
    p = policy()
    healthy = ViewBuilder().replicas(4).build()
    owner = p.choose(make_request("s"), healthy).first
    assert owner is not None
    down = ViewBuilder().replicas(4).unhealthy(owner).build()
    moved = p.choose(make_request("s"), down)
    assert moved.first != owner and owner not in moved.ranked and moved.reason == "failover"
    assert p.choose(make_request("s"), healthy).first == owner


def test_bounded_load_and_reason() -> None:
    p = policy(load_factor=1.25)
    base = ViewBuilder().replicas(4)
    owner = p.choose(make_request("s"), base.build()).first
    assert owner is not None
    hot = ViewBuilder().replicas(4).inflight({owner: 20}).build()
    choice = p.choose(make_request("s"), hot)
    assert choice.first != owner and choice.reason == "bounded_load" and choice.ranked[-1] == owner
    unbounded = policy(load_factor=None)
    assert unbounded.choose(make_request("s"), hot).first == owner


def test_model_filter_and_no_candidates() -> None:
    p = policy()
    view = ViewBuilder().replicas(3).models("r0", "a").models("r1", "b").models("r2", "b").build()
    for i in range(50):
        assert p.choose(make_request(f"s{i}", model="a"), view).ranked == ("r0",)
    assert p.choose(make_request(model="zzz"), view).reason == "no_candidates"


def test_weights_shift_share() -> None:
    p = policy()
    view = ViewBuilder().replicas(2).weight("r0", 3.0).build()
    counts = Counter(p.choose(make_request(f"s{i}"), view).first for i in range(4000))
    assert 2.4 < counts["r0"] / counts["r1"] < 3.6


def test_membership_change_rebuilds_only_when_needed() -> None:
    p = policy()
    assert isinstance(p, ReactsToMembership)
    three = ViewBuilder().replicas(3).build()
    four = ViewBuilder().replicas(4).build()
    before = {f"s{i}": p.choose(make_request(f"s{i}"), three).first for i in range(2000)}
    after = {k: p.choose(make_request(k), four).first for k in before}
    moved = [k for k in before if before[k] != after[k]]
    assert all(after[k] == "r3" for k in moved)
    assert 0.15 < len(moved) / len(before) < 0.35


def test_sticky_placement_is_optional() -> None:
    view = ViewBuilder().replicas(4).build()
    owner = policy().choose(make_request("s"), view).first
    other = ReplicaId("r0" if owner != "r0" else "r1")
    req = make_request("s", sticky_replica=other)
    assert policy().choose(req, view).first == owner
    honoring = policy(honor_sticky=True).choose(req, view)
    assert honoring.first == other and honoring.reason == "sticky"


def test_config_validation() -> None:
    with pytest.raises(ConfigError):
        build_policy("consistent_hash", {"vnodes": 0}, PolicyContext())
    with pytest.raises(ConfigError):
        build_policy("consistent_hash", {"load_factor": 0.5}, PolicyContext())
    built = build_policy("consistent_hash", {"vnodes": 50}, PolicyContext())
    assert isinstance(built, ConsistentHash) and built.config.vnodes == 50  # type: ignore[attr-defined]


def test_narrowed_views_place_like_the_full_ring_and_reuse_rings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import plugins.consistent_hash as module

    built: list[int] = []
    real = module.HashRing

    def counting(*args: object, **kwargs: object) -> object:
        built.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(module, "HashRing", counting)
    p = policy()
    full = ViewBuilder().replicas(4).unhealthy("r2").build()
    narrowed = ViewBuilder().replicas(4).build()
    narrowed = type(full)(tuple(r for r in narrowed.replicas if r.id != "r2"), full.now)
    for i in range(300):
        req = make_request(f"s{i}")
        assert p.choose(req, full).first == p.choose(req, narrowed).first
    before = len(built)
    other = ViewBuilder().replicas(2).build()
    for i in range(50):  # two views alternating (as per-model narrowing does): no rebuilds
        p.choose(make_request(f"s{i}"), narrowed)
        p.choose(make_request(f"s{i}"), other)
    assert len(built) - before == 1
