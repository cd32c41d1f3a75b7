"""KV pressure: the uncached prefill a replica took in over a few mean gaps between a
session's requests, over its KV capacity; and the weight a recomputed token gets from it."""

from __future__ import annotations

import math

import pytest

from gateway.types import ReplicaId
from plugins.kv_pressure import GAPS, KvPressure, token_weight

R = ReplicaId("r0")


def test_before_any_gap_is_measured_the_pressure_is_full() -> None:
    p = KvPressure()
    p.sent(R, 10.0, now=0.0)
    assert p.mean_gap_s is None
    assert p.of(R, 1_000_000, now=0.0) == 1.0


def test_intake_over_capacity_and_capped_at_one() -> None:
    p = KvPressure()
    p.gap(10.0)
    p.sent(R, 25_000.0, now=0.0)
    assert p.of(R, 100_000, now=0.0) == pytest.approx(0.25)
    p.sent(R, 200_000.0, now=0.0)
    assert p.of(R, 100_000, now=0.0) == 1.0
    assert p.of(ReplicaId("other"), 100_000, now=0.0) == 0.0


def test_the_intake_decays_over_gaps_mean_gaps() -> None:
    p = KvPressure()
    p.gap(10.0)
    p.sent(R, 50_000.0, now=100.0)
    later = 100.0 + GAPS * 10.0
    assert p.of(R, 100_000, now=later) == pytest.approx(0.5 / math.e)
    # A dispatch after the decay adds to what is left, not to the old total.
    p.sent(R, 10_000.0, now=later)
    assert p.of(R, 100_000, now=later) == pytest.approx(0.5 / math.e + 0.1)


def test_the_gap_is_a_running_mean_and_negative_gaps_are_ignored() -> None:
    p = KvPressure()
    p.gap(10.0)
    p.gap(-5.0)
    assert p.mean_gap_s == 10.0
    p.gap(30.0)
    assert p.mean_gap_s is not None and 10.0 < p.mean_gap_s < 30.0


def test_unknown_capacity_counts_as_full_pressure_and_forget_clears() -> None:
    p = KvPressure()
    p.gap(1.0)
    p.sent(R, 5.0, now=0.0)
    assert p.of(R, 0, now=0.0) == 1.0
    p.forget(R)
    assert p.of(R, 100, now=0.0) == 0.0


def test_the_weight_runs_from_one_plus_one_over_n_to_the_ceiling() -> None:
    assert token_weight(0.0, 8, 16.0) == pytest.approx(1.125)
    assert token_weight(1.0, 8, 16.0) == pytest.approx(16.0)
    assert token_weight(0.5, 8, 16.0) == pytest.approx(1.125 + 0.5 * 14.875)
    # A configured weight below the floor is what the operator asked for.
    assert token_weight(0.0, 8, 1.0) == 1.0
    assert token_weight(0.3, 0, 16.0) == pytest.approx(2.0 + 0.3 * 14.0)
