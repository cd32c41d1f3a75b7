"""Clocks for the engine model.

The model itself never reads a clock: callers pass `now`. The runner asks a `Clock` for
`now` and sleeps on it, so the same model runs in real time (optionally sped up) under the
HTTP server and in virtual time in the offline simulator.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Simulated seconds since an arbitrary origin."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` of simulated time."""
        ...


class RealClock:
    """Wall time, running `time_scale` times faster than real (2.0: a 1 s step takes 0.5 s)."""

    def __init__(self, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.time_scale = time_scale
        self._origin = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self._origin) * self.time_scale

    def to_real(self, seconds: float) -> float:
        return seconds / self.time_scale

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds) / self.time_scale)


class VirtualClock:
    """Time that moves only when the driver says so (`advance` / `advance_to`)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("time cannot go backwards")
        self._now += seconds

    def advance_to(self, t: float) -> None:
        self._now = max(self._now, t)

    async def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))
        await asyncio.sleep(0)
