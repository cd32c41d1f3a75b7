from __future__ import annotations

from collections import Counter

from policy_views import load, replicas, request, rid, view

from gateway.policy import PolicyContext, build_policy
from plugins.least_load import LeastLoad, LeastLoadConfig


def make(**cfg: object) -> LeastLoad:
    policy = build_policy("least_load", cfg, PolicyContext())
    assert isinstance(policy, LeastLoad)
    return policy


def test_picks_shortest_queue_and_ranks_everyone() -> None:
    v = view(replicas(4), {0: load(waiting=5), 1: load(waiting=1), 2: load(waiting=3), 3: load(8)})
    choice = make().choose(request("s"), v)
    assert choice.ranked == (rid(1), rid(2), rid(0), rid(3))
    assert choice.policy == "least_load"


def test_kv_pressure_counts() -> None:
    v = view(replicas(2), {0: load(waiting=1, kv=0.2), 1: load(waiting=0, kv=0.95)})
    assert make().choose(request("s"), v).first == rid(0)


def test_unreported_inflight_counts_as_waiting() -> None:
    # The scrape says both idle, but this gateway just sent 3 requests to r0.
    v = view(replicas(2), inflight={0: 3})
    assert make().choose(request("s"), v).first == rid(1)


def test_inflight_already_reported_is_not_double_counted() -> None:
    v = view(replicas(2), {0: load(running=2), 1: load(running=2, waiting=1)}, inflight={0: 2})
    assert make().choose(request("s"), v).first == rid(0)


def test_unknown_and_stale_load_rank_last() -> None:
    v = view(replicas(3), {0: None, 1: load(waiting=6), 2: load(age=5.0)})
    ranked = make().choose(request("s"), v).ranked
    assert ranked[0] == rid(1)
    assert set(ranked[1:]) == {rid(0), rid(2)}


def test_weight_divides_load() -> None:
    states = replicas(2)
    heavy = (states[0], type(states[1])(states[1].id, states[1].url, weight=4.0))
    v = view(heavy, {0: load(waiting=2), 1: load(waiting=4)})
    assert make().choose(request("s"), v).first == rid(1)


def test_ties_follow_session_hash_not_list_order() -> None:
    states = replicas(8)
    firsts = Counter(make().choose(request(f"s{i}"), view(states)).first for i in range(400))
    assert len(firsts) == 8 and max(firsts.values()) < 90
    p = make()
    for i in range(50):
        forward = p.choose(request(f"s{i}"), view(states)).first
        backward = p.choose(request(f"s{i}"), view(tuple(reversed(states)))).first
        assert forward == backward


def test_config_is_validated() -> None:
    assert LeastLoadConfig.model_validate({"weights": {"waiting": 2}}).weights.waiting == 2
