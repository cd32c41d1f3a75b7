from __future__ import annotations

import itertools
from collections import Counter

from policy_views import load, replicas, request, rid, view

from gateway.policy import PolicyContext, build_policy
from gateway.types import ClusterView, ReplicaId, RouteRequest
from plugins.prefix_affinity import PrefixAffinity

_ids = itertools.count(1_000_000)


def make(n: int = 8, **cfg: object) -> PrefixAffinity:
    policy = build_policy("prefix_affinity", cfg, PolicyContext(replicas=replicas(n)))
    assert isinstance(policy, PrefixAffinity)
    return policy


def fresh_blocks(n: int) -> list[int]:
    return [next(_ids) for _ in range(n)]


def route(policy: PrefixAffinity, req: RouteRequest, v: ClusterView) -> ReplicaId:
    first = policy.choose(req, v).first
    assert first is not None
    policy.placed(req, first)
    return first


def test_new_conversations_spread_over_the_ring_and_stay_put() -> None:
    p, v = make(), view(replicas(8))
    homes = {}
    for i in range(800):
        homes[i] = p.choose(request(f"s{i}", fresh_blocks(10)), v)
        assert homes[i].reason == "ring"
    counts = Counter(c.first for c in homes.values())
    assert len(counts) == 8 and max(counts.values()) < 1.35 * 100
    # Same session, unseen prompt: same ring home on every decision.
    assert p.choose(request("s1", fresh_blocks(10)), v).first == homes[1].first


def test_continuation_follows_the_prefix_not_the_ring() -> None:
    p, v = make(), view(replicas(8))
    turn1 = fresh_blocks(40)
    p.placed(request("conv", turn1), rid(5))
    # A later turn (different session key, e.g. no header) extends the same prompt.
    choice = p.choose(request("other-key", turn1 + fresh_blocks(5)), v)
    assert choice.first == rid(5)
    assert choice.reason == "prefix_match"


def test_shared_system_prompt_does_not_collapse_traffic() -> None:
    p, states = make(), replicas(8)
    system = fresh_blocks(4)
    inflight: Counter[int] = Counter()
    placed: Counter[ReplicaId] = Counter()
    for i in range(800):
        req = request(f"s{i}", system + fresh_blocks(16))
        where = route(p, req, view(states, inflight=dict(inflight)))
        placed[where] += 1
        inflight[int(where[1:])] += 1
        if i % 4 == 3:  # requests finish at a steady rate
            for k in list(inflight):
                inflight[k] = max(0, inflight[k] - 1)
    assert len(placed) == 8
    assert max(placed.values()) <= 1.35 * 100, placed


def test_large_shared_prefix_held_everywhere_is_not_a_reason() -> None:
    # Once every replica holds the long shared prefix it stops pulling traffic anywhere.
    p, v = make(), view(replicas(4))
    shared = fresh_blocks(30)
    for i in range(4):
        p.placed(request(f"warm{i}", shared), rid(i))
    firsts = Counter(
        p.choose(request(f"s{i}", shared + fresh_blocks(3)), v).first for i in range(400)
    )
    assert len(firsts) == 4 and max(firsts.values()) < 160


def test_overloaded_replica_sheds_even_with_the_best_match() -> None:
    p = make()
    blocks = fresh_blocks(400)
    p.placed(request("conv", blocks), rid(2))
    busy = view(replicas(8), {2: load(waiting=12, running=8, kv=0.9)})
    choice = p.choose(request("conv", blocks + fresh_blocks(2)), busy)
    assert choice.first != rid(2)
    assert choice.ranked[-1] == rid(2)
    assert choice.reason == "shed"
    # A short queue is worth waiting in for a 6400-token match.
    mild = view(replicas(8), {2: load(waiting=1, running=1)})
    assert p.choose(request("conv", blocks + fresh_blocks(2)), mild).first == rid(2)


def test_unknown_or_stale_load_is_saturated() -> None:
    p = make(4)
    blocks = fresh_blocks(20)
    p.placed(request("conv", blocks), rid(1))
    for gone in (None, load(age=10.0)):
        v = view(replicas(4), {1: gone})
        ranked = p.choose(request("conv", blocks), v).ranked
        assert ranked[0] != rid(1) and ranked[-1] == rid(1)


def test_nothing_scraped_uses_local_inflight_only() -> None:
    p = make(4)
    blocks = fresh_blocks(20)
    p.placed(request("conv", blocks), rid(3))
    v = view(replicas(4), {i: None for i in range(4)}, inflight={0: 1})
    assert p.choose(request("conv", blocks), v).first == rid(3)


def test_ties_do_not_depend_on_list_order() -> None:
    p = make()
    states = replicas(8)
    for i in range(100):
        req = request(f"s{i}", fresh_blocks(3))
        assert p.choose(req, view(states)).first == p.choose(req, view(states[::-1])).first


def test_index_size_follows_scraped_capacity() -> None:
    p = make(2)
    v = view(replicas(2), default_load=load(capacity=16 * 50))
    p.choose(request("a", fresh_blocks(1)), v)
    p.placed(request("a", fresh_blocks(400)), rid(0))
    assert p.index.size(rid(0)) == 50


def test_unit_tracks_prefill_actually_needed() -> None:
    p = make(2, initial_request_tokens=5000, ewma_alpha=0.5, min_request_tokens=16)
    blocks = fresh_blocks(10)
    p.placed(request("a", blocks), rid(0))
    p.placed(request("a", blocks), rid(0))  # fully cached: needs no prefill
    assert p.unit_tokens < 5000 / 2


def test_membership_change_forgets_removed_replicas() -> None:
    p = make(3)
    p.placed(request("a", fresh_blocks(5)), rid(2))
    p.membership_changed(replicas(2))
    assert p.index.size(rid(2)) == 0


def test_miss_goes_where_the_consistent_hash_ring_says() -> None:
    from gateway.ring import HashRing, RingNode

    ring = HashRing(RingNode(r.id) for r in replicas(8))
    p = make()
    for i in range(100):
        assert (
            p.choose(request(f"s{i}", fresh_blocks(3)), view(replicas(8))).first
            == ring.walk(f"s{i}")[0]
        )
    # An overloaded ring owner passes the session on to the next replica clockwise.
    walk = ring.walk("s0")
    owner = int(walk[0][1:])
    busy = view(replicas(8), {owner: load(waiting=30)})
    assert p.choose(request("s0", fresh_blocks(3)), busy).first == walk[1]
