"""Timeline events: ejections, re-admissions, membership and pool-weight changes."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

MAX_EVENTS = 1000


@dataclass(frozen=True, slots=True)
class Event:
    at: float  # wall clock
    kind: str  # ejected | half_open | healthy | added | removed | weights
    subject: str  # a replica id, or a pool for weights
    detail: str = ""


class EventLog:
    """Bounded by count and by age (`horizon_s`, the console's history)."""

    def __init__(self, horizon_s: float, *, clock: Callable[[], float] = time.time) -> None:
        self._events: deque[Event] = deque(maxlen=MAX_EVENTS)
        self._horizon_s = horizon_s
        self._clock = clock

    def add(self, kind: str, subject: str, detail: str = "") -> None:
        self._events.append(Event(self._clock(), kind, subject, detail))

    def recent(self) -> list[dict[str, Any]]:
        cutoff = self._clock() - self._horizon_s
        events = self._events
        while events and events[0].at < cutoff:
            events.popleft()
        return [asdict(e) for e in events]
