"""Per-replica error shares: failed attempts (given up on, or 5xx relayed) over attempts,
across the last minute of the sampler's totals."""

from __future__ import annotations

from collections import deque

from gateway.console.counters import Samples, replica_failures
from gateway.console.sampler import error_shares


def test_retried_failures_and_relayed_5xx_count_against_their_replica() -> None:
    series: Samples = {
        "kvgate_requests_total": {
            (("endpoint", "chat"), ("replica", "a"), ("status", "200")): 80.0,
            (("endpoint", "chat"), ("replica", "a"), ("status", "500")): 5.0,
            (("endpoint", "chat"), ("replica", "b"), ("status", "200")): 100.0,
            (("endpoint", "chat"), ("replica", ""), ("status", "404")): 3.0,
        },
        "kvgate_upstream_failures_total": {
            (("kind", "upstream_503"), ("replica", "a")): 15.0,
        },
    }
    assert replica_failures(series) == {"a": (20.0, 100.0), "b": (0.0, 100.0)}


def test_the_share_spans_the_window_and_survives_a_reset() -> None:
    window: deque[tuple[float, dict[str, float]]] = deque()
    assert error_shares(window) == {}
    window.append((0.0, {"failed:a": 10.0, "attempts:a": 100.0, "attempts:b": 50.0}))
    window.append((30.0, {"failed:a": 30.0, "attempts:a": 200.0, "attempts:b": 50.0}))
    assert error_shares(window) == {"a": 0.2, "b": None}
    window.append((60.0, {"failed:a": 1.0, "attempts:a": 5.0, "attempts:b": 60.0}))
    shares = error_shares(window)
    assert shares["a"] is None and shares["b"] == 0.0
