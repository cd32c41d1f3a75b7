"""The prefill meter: queued uncached prefill per replica and speed learnt from first tokens."""

from __future__ import annotations

import pytest

from gateway.prefill_meter import PrefillMeter
from gateway.types import ReplicaId

A, B = ReplicaId("a"), ReplicaId("b")


def test_speed_is_learnt_from_first_tokens_while_busy() -> None:
    m = PrefillMeter(memory=1.0)
    assert m.speed(A) is None and m.mean_speed() is None
    t = 0.0
    for i in range(4):  # back to back: 10,000 tokens a second
        m.dispatched(f"r{i}", A, 5_000, t)
        assert m.queued_tokens(A) == 5_000 and m.queued_requests(A) == 1
        t += 0.5
        m.first_token(f"r{i}", t)
        assert m.queued_tokens(A) == 0
        t += 3.0  # idle time between requests is not prefill time
    assert m.measured(A) == pytest.approx(10_000)
    # A replica not measured yet borrows the cluster's mean.
    assert m.speed(B) == pytest.approx(10_000)


def test_queued_requests_finish_one_after_another() -> None:
    m = PrefillMeter(memory=1.0, min_samples=2)
    m.dispatched("x", A, 4_000, 0.0)
    m.dispatched("y", A, 4_000, 0.0)
    assert m.queued_tokens(A) == 8_000
    m.first_token("x", 1.0)
    m.first_token("y", 2.0)
    assert m.measured(A) == pytest.approx(4_000)


def test_failed_attempts_leave_the_queue_without_a_sample() -> None:
    m = PrefillMeter()
    m.dispatched("x", A, 4_000, 0.0)
    m.dispatched("x", B, 3_000, 0.1)  # the retry replaces its first attempt
    assert m.queued_tokens(A) == 0 and m.queued_tokens(B) == 3_000
    m.abandoned("x")
    m.abandoned("x")
    m.first_token("x", 9.0)  # idempotent, nothing open
    assert m.queued_tokens(B) == 0 and m.measured(B) is None
    m.forget(B)
    assert m.queued_requests(B) == 0
