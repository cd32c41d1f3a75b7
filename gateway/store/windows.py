"""Sliding-window counting from two fixed windows (pure functions).

The current fixed window's count plus the previous window's count weighted by the share of
it the sliding window still covers. Two integers per key per window, no timestamps list,
so the state per key is constant whatever the rate.
"""

from __future__ import annotations

import math


def window_index(now: float, window_s: float) -> int:
    return math.floor(now / window_s)


def sliding_estimate(previous: float, current: float, now: float, window_s: float) -> float:
    elapsed = now / window_s - math.floor(now / window_s)
    return previous * (1.0 - elapsed) + current
