"""Every built-in policy, behind the router the proxy builds (filters, scorer), held to the
same contract: a config key it does not know fails start-up naming the section; no
candidates, one candidate, a model only one replica serves and a cluster where every
replica is saturated each get a well-formed ranking of candidates only."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from policy_views import load, replicas, request, rid, view

from gateway.errors import ConfigError
from gateway.policy import BUILTIN_POLICIES, RANK_DEPTH, Policy, PolicyContext, build_policy
from gateway.routing import RoutingSettings, build_router
from gateway.types import ClusterView, ReplicaState

NAMES = sorted(BUILTIN_POLICIES)
HASHES = (11, 12, 13, 14)


def router(name: str, states: tuple[ReplicaState, ...]) -> Policy:
    return build_router(RoutingSettings(policy=name), PolicyContext(states))


@pytest.mark.parametrize("name", NAMES)
def test_an_unknown_config_key_fails_start_up_naming_the_section(name: str) -> None:
    settings = RoutingSettings(policy=name, policies={name: {"no_such_knob": 1}})
    with pytest.raises(ConfigError) as caught:
        build_router(settings, PolicyContext(replicas(2)))
    assert caught.value.param == f"routing.policies.{name}"
    assert "no_such_knob" in caught.value.message


@pytest.mark.parametrize("name", NAMES)
def test_no_candidates_is_an_empty_ranking_not_an_error(name: str) -> None:
    states = replicas(3)
    # The policy itself, handed an empty view (a pool with no members yet)...
    alone = build_policy(name, {}, PolicyContext(states))
    empty = ClusterView((), 1000.0, 2.0, {})
    assert alone.choose(request("s", HASHES), empty).ranked == ()
    # ...and behind the router: every replica down, or none serving the model.
    r = router(name, states)
    down = view(tuple(dataclasses.replace(s, healthy=False) for s in states))
    assert r.choose(request("s", HASHES), down).ranked == ()
    other = view(tuple(dataclasses.replace(s, models=frozenset({"x"})) for s in states))
    choice = r.choose(request("s", HASHES), other)
    assert (choice.ranked, choice.reason) == ((), "no_candidates")


@pytest.mark.parametrize("name", NAMES)
def test_one_candidate_is_the_answer_whatever_it_holds(name: str) -> None:
    states = replicas(4)
    r = router(name, states)
    # Only r2 serves the model: the others are not candidates, however idle.
    only = tuple(
        s if s.id == rid(2) else dataclasses.replace(s, models=frozenset({"x"})) for s in states
    )
    busy = view(only, {2: load(waiting=50, kv=0.99)})
    for session in ("a", "b", "c"):
        assert r.choose(request(session, HASHES), busy).ranked == (rid(2),)
    single = view(replicas(1))
    assert router(name, replicas(1)).choose(request("a", HASHES), single).ranked == (rid(0),)


@pytest.mark.parametrize("name", NAMES)
def test_all_saturated_still_ranks_every_candidate_once(name: str) -> None:
    states = replicas(5)
    r = router(name, states)
    full = view(states, default_load=load(waiting=100, kv=0.99), inflight={i: 30 for i in range(5)})
    for session in ("a", "b", "c", "d"):
        ranked = r.choose(request(session, HASHES), full).ranked
        # Admission, not routing, decides to queue: failover keeps somewhere to go.
        assert sorted(ranked) == sorted(s.id for s in states)
    # Unknown load (never scraped) counts as saturated the same way.
    blind = view(states, default_load=None)
    assert len(r.choose(request("e", HASHES), blind).ranked) == 5


@pytest.mark.parametrize("name", NAMES)
def test_rankings_stop_at_the_failover_depth(name: str) -> None:
    states = replicas(RANK_DEPTH + 8)
    ranked = router(name, states).choose(request("a", HASHES), view(states)).ranked
    assert RANK_DEPTH <= len(ranked) <= len(states)
    assert len(set(ranked)) == len(ranked)


def test_consistent_hash_shares_sessions_by_weight() -> None:
    states = replicas(2)
    heavy = (dataclasses.replace(states[0], weight=3.0), states[1])
    r = router("consistent_hash", heavy)
    v = view(heavy)
    firsts = Counter(r.choose(request(f"s{i}"), v).first for i in range(4000))
    share = firsts[rid(0)] / 4000
    assert 0.68 < share < 0.82, firsts


def test_least_load_divides_load_by_weight() -> None:
    states = replicas(2)
    big = (states[0], dataclasses.replace(states[1], weight=4.0))
    # r1 carries twice r0's queue but has four times its weight: it is the less loaded.
    v = view(big, {0: load(waiting=2, running=2), 1: load(waiting=4, running=4)})
    r = router("least_load", big)
    assert r.choose(request("a"), v).first == rid(1)
    even = view(states, {0: load(waiting=2, running=2), 1: load(waiting=4, running=4)})
    assert router("least_load", states).choose(request("a"), even).first == rid(0)
