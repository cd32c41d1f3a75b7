"""Every built-in policy behind the router, over seeded random clusters and traffic: a
ranking holds only replicas that are healthy and serve the model, each once, never deeper
than the failover depth, and is empty only when no replica qualifies."""

from __future__ import annotations

import dataclasses
import random

import pytest
from policy_views import load, replicas, request, view

from gateway.policy import BUILTIN_POLICIES, RANK_DEPTH, PolicyContext
from gateway.routing import RoutingSettings, build_router
from gateway.types import ClusterView, EngineLoad, ReplicaState


def _cluster(rng: random.Random) -> tuple[tuple[ReplicaState, ...], ClusterView]:
    n = rng.randint(1, 7)
    states = tuple(
        dataclasses.replace(
            s,
            healthy=rng.random() > 0.2,
            weight=rng.choice([1.0, 1.0, 2.0, 0.5]),
            models=frozenset(rng.sample(["m", "other"], rng.randint(0, 2))),
        )
        for s in replicas(n)
    )
    loads: dict[int, EngineLoad | None] = {}
    for i in range(n):
        roll = rng.random()
        if roll < 0.15:
            loads[i] = None  # never scraped
        elif roll < 0.3:
            loads[i] = load(waiting=rng.randint(0, 9), age=rng.uniform(3, 30))  # stale
        else:
            loads[i] = load(
                waiting=rng.randint(0, 20),
                running=rng.randint(0, 64),
                kv=rng.choice([None, rng.random()]),
            )
    inflight = {i: rng.randint(0, 12) for i in range(n) if rng.random() < 0.5}
    return states, view(states, loads, inflight)


@pytest.mark.parametrize("name", sorted(BUILTIN_POLICIES))
def test_rankings_are_well_formed_on_random_clusters(name: str) -> None:
    rng = random.Random(name)
    states, _ = _cluster(rng)
    router = build_router(RoutingSettings(policy=name), PolicyContext(states))
    systems = [[rng.randrange(1 << 40) for _ in range(4)] for _ in range(3)]
    for round_ in range(60):
        states, v = _cluster(rng)
        if hasattr(router, "membership_changed"):
            router.membership_changed(v.replicas)
        eligible = {r.id for r in v.replicas if r.healthy and (not r.models or "m" in r.models)}
        for s in range(4):
            hashes = [*rng.choice(systems), *(rng.randrange(1 << 40) for _ in range(s))]
            choice = router.choose(request(f"s{round_}-{s}", hashes), v)
            ranked = list(choice.ranked)
            assert len(ranked) == len(set(ranked)) <= RANK_DEPTH
            assert set(ranked) <= eligible, (choice.reason, eligible)
            assert bool(ranked) == bool(eligible), choice.reason
