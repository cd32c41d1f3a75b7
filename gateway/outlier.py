"""Outlier detection over proxied answers, the way Envoy's outlier detector works.

A replica can answer `/health` and still fail many of the requests it gets (a broken GPU,
a half-loaded model). Two signals catch it, both over *different* requests:

* `consecutive_5xx` 5xx answers in a row, each to a request (body) not counted before;
* a 5xx share, over the last `interval_s`, at least `min_failure_share` and at least
  `failure_share_factor` times the share of the rest of the fleet, once the replica and the
  rest each answered `request_volume` requests.

What is the request's fault, not the replica's, is never counted:

* the same request (same path and body) failing again: it counts once (a client retrying a
  poisoned request cannot eject the replica that keeps answering it);
* a request that fails on two replicas: it is excused on both;
* a kind of request (its path) that the replica fails every time while it serves other kinds
  (issue 19's poison: a replica answering 500 to one kind only stays in service).

A 503 (the engine's queue is full) is load, not sickness, and is not counted either.
This module only keeps the books and says when; `gateway.health` ejects (with the maximum
ejection share and never the last replica in service).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gateway.settings import OutlierSettings
from gateway.types import ReplicaId

NOT_COUNTED = frozenset({503})  # the engine's own overload answer (vLLM: queue full)
CONSECUTIVE = "consecutive_5xx"
FAILURE_SHARE = "failure_share"


def fingerprint(path: str, body: bytes) -> int:
    """What makes two requests "the same request"."""
    return hash((path, body))


@dataclass(slots=True)
class _Window:
    # (time, kind, fingerprint of a counted failure or None for a success)
    events: deque[tuple[float, str, int | None]] = field(default_factory=deque)
    ok: Counter[str] = field(default_factory=Counter)
    bad: Counter[str] = field(default_factory=Counter)
    bad_fps: dict[int, str] = field(default_factory=dict)
    streak: list[int] = field(default_factory=list)

    def prune(self, oldest: float) -> None:
        events = self.events
        while events and events[0][0] < oldest:
            _, kind, fp = events.popleft()
            if fp is None:
                self.ok[kind] -= 1
            elif self.bad_fps.get(fp) is not None:
                # Still counted (not excused since): its one window entry leaves now.
                del self.bad_fps[fp]
                self.bad[kind] -= 1

    def counted(self) -> tuple[int, int]:
        """(requests, failures) without the kinds this replica fails every time while it
        serves others (the kind's fault, not the replica's)."""
        serves_some = any(n > 0 for n in self.ok.values())
        failed = total = 0
        for kind, n in self.bad.items():
            if n <= 0 or (serves_some and self.ok[kind] <= 0):
                continue
            failed += n
            total += n
        total += sum(n for n in self.ok.values() if n > 0)
        return total, failed

    def confined(self, kind: str) -> bool:
        return self.ok[kind] <= 0 and any(n > 0 for n in self.ok.values())


class OutlierDetector:
    """Books of proxied outcomes per replica; `failed` says when one is an outlier."""

    def __init__(self, settings: OutlierSettings, clock: Callable[[], float]) -> None:
        self.settings = settings
        self.clock = clock
        self._windows: dict[ReplicaId, _Window] = {}
        # Fingerprints that failed on two replicas, with when: never counted again.
        self._excused: dict[int, float] = {}

    def _window(self, replica: ReplicaId) -> _Window:
        window = self._windows.get(replica)
        if window is None:
            window = self._windows[replica] = _Window()
        window.prune(self.clock() - self.settings.interval_s)
        return window

    def succeeded(self, replica: ReplicaId, kind: str) -> None:
        window = self._window(replica)
        window.events.append((self.clock(), kind, None))
        window.ok[kind] += 1
        window.streak.clear()

    def failed(
        self, replica: ReplicaId, kind: str, fp: int, status: int, others: Iterable[ReplicaId]
    ) -> str | None:
        """One 5xx answer: the reason to eject `replica`, or None."""
        if status in NOT_COUNTED or not self.settings.enabled:
            return None
        now = self.clock()
        self._forget_excused(now)
        if fp in self._excused:
            return None
        window = self._window(replica)
        if fp in window.bad_fps:
            return None  # the same request again: counted once
        for other in others:
            held = self._windows.get(other)
            if held is not None and fp in held.bad_fps:
                # Failed on another replica too: the request's fault, on both.
                held.bad[held.bad_fps.pop(fp)] -= 1
                if fp in held.streak:
                    held.streak.remove(fp)
                self._excused[fp] = now
                return None
        window.events.append((now, kind, fp))
        window.bad[kind] += 1
        window.bad_fps[fp] = kind
        if not window.confined(kind):
            window.streak.append(fp)
        if len(window.streak) >= self.settings.consecutive_5xx:
            return CONSECUTIVE
        if self._share_outlier(replica, window):
            return FAILURE_SHARE
        return None

    def _share_outlier(self, replica: ReplicaId, window: _Window) -> bool:
        s = self.settings
        total, failed = window.counted()
        if total < s.request_volume or failed / total < s.min_failure_share:
            return False
        rest_total = rest_failed = 0
        for other, held in self._windows.items():
            if other == replica:
                continue
            held.prune(self.clock() - s.interval_s)
            t, f = held.counted()
            rest_total += t
            rest_failed += f
        if rest_total < s.request_volume:
            return False  # nothing to stand above
        return failed / total >= s.failure_share_factor * (rest_failed / rest_total)

    def share(self, replica: ReplicaId) -> float:
        """The replica's counted 5xx share in the current window (0 without requests)."""
        total, failed = self._window(replica).counted()
        return failed / total if total else 0.0

    def reset(self, replica: ReplicaId) -> None:
        """Forget a replica's books (ejected: it starts afresh when it comes back)."""
        self._windows.pop(replica, None)

    def _forget_excused(self, now: float) -> None:
        if len(self._excused) > 4096 or (
            self._excused and next(iter(self._excused.values())) < now - self.settings.interval_s
        ):
            oldest = now - self.settings.interval_s
            self._excused = {fp: t for fp, t in self._excused.items() if t >= oldest}
