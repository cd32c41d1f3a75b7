"""The churn meter: a replica's recent KV writes, aged by what the whole cluster wrote since."""

from __future__ import annotations

import math

import pytest

from gateway.types import ReplicaId
from plugins.cache_churn import ChurnMeter

A, B = ReplicaId("a"), ReplicaId("b")


def test_writes_add_up_until_others_write() -> None:
    m = ChurnMeter(horizon_tokens=1000)
    m.write(A, 100)
    m.write(A, 50)
    # The second write came after 100 tokens of the cluster's writes: the first aged.
    assert m.churn(A) == pytest.approx(100 * math.exp(-50 / 1000) + 50)
    assert m.churn(B) == 0.0


def test_what_the_cluster_writes_elsewhere_ages_a_replica() -> None:
    m = ChurnMeter(horizon_tokens=1000)
    m.write(A, 400)
    before = m.churn(A)
    m.write(B, 1000)  # one cluster capacity written elsewhere
    assert m.churn(A) == pytest.approx(before / math.e)
    assert m.churn(B) == pytest.approx(1000)


def test_nothing_written_and_a_forgotten_replica_count_nothing() -> None:
    m = ChurnMeter(horizon_tokens=1000)
    m.write(A, 0)
    m.write(A, -5)
    assert m.churn(A) == 0.0
    m.write(A, 10)
    m.forget(A)
    assert m.churn(A) == 0.0


def test_a_larger_cluster_remembers_longer() -> None:
    small, large = ChurnMeter(1000), ChurnMeter(1000)
    large.set_horizon(8000)
    for m in (small, large):
        m.write(A, 500)
        m.write(B, 2000)
    assert large.horizon_tokens == 8000
    assert small.churn(A) < large.churn(A) < 500


def test_long_runs_and_a_new_horizon_keep_the_values() -> None:
    m, ref = ChurnMeter(100), {A: 0.0, B: 0.0}
    for i in range(2000):  # 40 horizons of writes: the shared factor is folded in on the way
        who = A if i % 3 else B
        for r in ref:
            ref[r] *= math.exp(-5 / 100)
        ref[who] += 5
        m.write(who, 5)
    assert m.churn(A) == pytest.approx(ref[A]) and m.churn(B) == pytest.approx(ref[B])
    m.set_horizon(400)
    assert m.churn(A) == pytest.approx(ref[A])
    m.write(B, 40)
    assert m.churn(A) == pytest.approx(ref[A] * math.exp(-40 / 400))
