"""Where a session's placement meets membership: `prefix_affinity` forgets a departed
replica's prefixes and builds its ring from the view when never told the members;
`consistent_hash` honours a store's sticky placement only on a replica still eligible."""

from __future__ import annotations

import dataclasses

from policy_views import replicas, request, rid, view

from gateway.policy import PolicyContext
from gateway.testing.views import ViewBuilder, make_request
from gateway.types import ReplicaId
from plugins.consistent_hash import ConsistentHash, ConsistentHashConfig
from plugins.prefix_affinity import PrefixAffinity, PrefixAffinityConfig

PREFIX = tuple(range(40, 60))


def affinity(context_replicas: int) -> PrefixAffinity:
    return PrefixAffinity(PrefixAffinityConfig(), PolicyContext(replicas(context_replicas)))


def test_a_departed_replica_s_prefixes_are_forgotten_and_followed_no_more() -> None:
    p = affinity(3)
    v = view(replicas(3))
    req = request("a", PREFIX)
    p.placed(req, rid(1))
    assert p.cached_tokens(req, rid(1)) == len(PREFIX) * 16
    fork = request("b", PREFIX)
    assert p.choose(fork, v).first == rid(1)  # a new session follows the prefix
    p.membership_changed(replicas(3)[::2])  # r1 leaves
    assert p.cached_tokens(req, rid(1)) == 0
    narrowed = view(replicas(3)[::2])
    assert p.choose(fork, narrowed).reason != "prefix_match"


def test_a_full_match_of_the_hashed_blocks_counts_the_whole_prompt() -> None:
    p = affinity(2)
    # Only the first blocks of a long prompt are hashed: all of them matched means the
    # replica most likely holds the rest too.
    long = dataclasses.replace(request("a", PREFIX), prompt_tokens=10 * len(PREFIX) * 16)
    p.placed(long, rid(0))
    assert p.cached_tokens(long, rid(0)) == long.prompt_tokens
    partial = request("b", PREFIX[:10] + (999,) * 10)
    assert p.cached_tokens(partial, rid(0)) == 10 * 16
    p.placed(request("c", ()), rid(1))  # nothing to index
    assert p.cached_tokens(request("c", PREFIX), rid(1)) == 0


def test_never_told_the_members_the_ring_comes_from_the_view() -> None:
    p = affinity(0)
    v = view(replicas(4))
    homes = {s: p.choose(request(s), v) for s in ("a", "b", "c", "d", "e", "f")}
    assert {c.reason for c in homes.values()} == {"ring"}
    # Stable: the same session goes home again, and sessions spread over the replicas.
    assert all(p.choose(request(s), v).first == c.first for s, c in homes.items())
    assert len({c.first for c in homes.values()}) > 1


def test_a_sticky_placement_on_a_replica_no_longer_eligible_is_ignored() -> None:
    built = ViewBuilder().replicas(4).unhealthy("r2").models("r3", "other")
    v = built.build()
    p = ConsistentHash(ConsistentHashConfig(honor_sticky=True), PolicyContext(v.replicas))
    owner = p.choose(make_request("s"), v)
    for gone in ("r2", "r3"):  # down, or no longer serving the model
        req = make_request("s", sticky_replica=ReplicaId(gone))
        choice = p.choose(req, v)
        assert choice.first == owner.first and choice.reason == owner.reason
        assert ReplicaId(gone) not in choice.ranked
    # Sticky on the ring's own first choice: the ring's answer, not a "sticky" move.
    already = p.choose(make_request("s", sticky_replica=owner.first), v)
    assert already.ranked == owner.ranked and already.reason == owner.reason
