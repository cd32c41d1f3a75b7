"""`ConsistentHash` caches rings per membership and eligibility per view; past the cache
bound, under churn, its answers must stay those of a policy that never cached anything."""

from __future__ import annotations

import random

from gateway.policy import PolicyContext
from gateway.testing.views import ViewBuilder, make_request
from gateway.types import ClusterView
from plugins.consistent_hash import ConsistentHash, ConsistentHashConfig


def _fresh() -> ConsistentHash:
    return ConsistentHash(ConsistentHashConfig(), PolicyContext())


def _random_view(rng: random.Random) -> ClusterView:
    builder = ViewBuilder().replicas(rng.randint(1, 6))
    n = len(builder.build().replicas)
    for i in range(n):
        if rng.random() < 0.3:
            builder.weight(f"r{i}", float(rng.randint(1, 3)))
    down = [f"r{i}" for i in range(n) if rng.random() < 0.2]
    if down:
        builder.unhealthy(*down)
    if rng.random() < 0.3:
        builder.models("r0", "other-model")
    return builder.build()


def test_answers_under_membership_churn_match_an_uncached_policy() -> None:
    rng = random.Random(7)
    cached = _fresh()
    views = [_random_view(rng) for _ in range(40)]  # more than the caches hold
    for round_ in range(3):
        for v in views:
            cached.membership_changed(v.replicas)
            for s in range(5):
                req = make_request(f"s{round_}-{s}")
                assert cached.choose(req, v) == _fresh().choose(req, v)


def test_a_view_rebuilt_at_a_reused_address_is_not_mistaken_for_the_old_one() -> None:
    p = _fresh()
    req = make_request("s")
    before = p.choose(req, ViewBuilder().replicas(3).build())
    # The old view is gone; a new one of other replicas may land at the same id().
    after_view = ViewBuilder().replicas(2, prefix="q").build()
    after = p.choose(req, after_view)
    assert set(after.ranked) <= {r.id for r in after_view.replicas}
    assert after == _fresh().choose(req, after_view)
    assert before.first in {"r0", "r1", "r2"}
