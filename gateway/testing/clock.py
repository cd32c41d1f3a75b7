"""A manual clock for deterministic tests of time-dependent parts (health, staleness)."""

from __future__ import annotations


class FakeClock:
    """Callable like `time.monotonic`; moves only when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("time does not go backwards")
        self.now += seconds
        return self.now
