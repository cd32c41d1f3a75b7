"""The load arithmetic the load-aware policies share: bounded KV pressure, and a top-k
ranking that agrees with sorting everything."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from pydantic import ValidationError

from gateway.types import EngineLoad, ReplicaId
from plugins.load_model import LoadWeights, RankKey, TieBreaker, add_ranked, load_terms


def test_kv_pressure_grows_with_usage_and_stays_finite_when_full() -> None:
    w = LoadWeights()
    values = [load_terms(EngineLoad(0, 0, kv_usage=u), w)[1] for u in (0.0, 0.25, 0.5, 0.9)]
    assert values == sorted(values) and values[0] == 0.0
    full = load_terms(EngineLoad(0, 0, kv_usage=1.0), w)[1]
    over = load_terms(EngineLoad(0, 0, kv_usage=7.0), w)[1]
    assert math.isfinite(full) and full == over and full > values[-1]
    # A gauge a hair below zero (float noise in a scrape) adds nothing, never a negative load.
    assert load_terms(EngineLoad(0, 0, kv_usage=-0.01), w)[1] == 0.0


def test_requests_are_counted_apart_from_their_weighted_load() -> None:
    w = LoadWeights(waiting=2.0, running=0.0, kv_usage=0.0)
    count, value = load_terms(EngineLoad(waiting=3, running=5, kv_usage=0.8), w)
    assert count == 8
    assert value == 2.0 * 3  # running and KV weighted out
    assert load_terms(EngineLoad(3, 5), w) == (count, value)


def test_weights_refuse_negative_and_unknown_fields() -> None:
    with pytest.raises(ValidationError):
        LoadWeights(waiting=-1)
    with pytest.raises(ValidationError):
        LoadWeights(queued=1)  # type: ignore[call-arg]


@pytest.mark.parametrize("seed", range(20))
def test_add_ranked_keeps_exactly_what_a_full_sort_puts_first(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 30)
    want = rng.randint(1, n + 2)
    # Few distinct values, so ties at the cut are common.
    pairs = [(float(rng.randint(0, 5)), i) for i in range(n)]
    hashes = [rng.getrandbits(64) for _ in range(n)]
    session = rng.getrandbits(64)
    out: list[RankKey] = []
    add_ranked(out, 1, pairs, want, session, hashes)
    full: list[RankKey] = []
    add_ranked(full, 1, pairs, n, session, hashes)
    assert len(full) == n
    ranked, everything = sorted(out), sorted(full)
    k = min(want, n)
    assert ranked[:k] == everything[:k]
    # Whatever was dropped lies strictly above the want-th smallest value.
    kept = {key[3] for key in out}
    cut = everything[k - 1][1]
    assert all(v > cut for v, i in pairs if i not in kept)
    assert all(key[0] == 1 for key in out)


def test_tie_order_is_stable_per_session_and_spread_across_sessions() -> None:
    replicas = [ReplicaId(f"r{i}") for i in range(4)]
    ties = TieBreaker()
    firsts: Counter[ReplicaId] = Counter()
    for s in range(400):
        h = ties.session_hash(f"session-{s}")
        order = sorted(replicas, key=lambda r: ties.rank(h, r))
        assert order == sorted(replicas, key=lambda r: TieBreaker().rank(h, r))
        firsts[order[0]] += 1
    # Every replica leads for some sessions, none for most: no list-order hot spot.
    assert set(firsts) == set(replicas)
    assert max(firsts.values()) < 400 * 0.4
