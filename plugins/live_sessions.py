"""Where each live conversation sits, and how many sit on each replica.

A session is live from its last request until `idle_s` later. The table is bounded
(`max_sessions`, least recently seen dropped first) and expires lazily, from the oldest
end, whenever it is touched: O(1) amortised per request, no timers.
"""

from __future__ import annotations

from collections import OrderedDict

from gateway.types import ReplicaId, SessionKey


class LiveSessions:
    __slots__ = ("_counts", "_seen", "idle_s", "max_sessions")

    def __init__(self, idle_s: float, max_sessions: int) -> None:
        self.idle_s = idle_s
        self.max_sessions = max(1, max_sessions)
        self._seen: OrderedDict[SessionKey, tuple[ReplicaId, float]] = OrderedDict()
        self._counts: dict[ReplicaId, int] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def replica_of(self, key: SessionKey, now: float) -> ReplicaId | None:
        entry = self._seen.get(key)
        if entry is None or now - entry[1] > self.idle_s:
            return None
        return entry[0]

    def count(self, replica: ReplicaId) -> int:
        return self._counts.get(replica, 0)

    @property
    def counts(self) -> dict[ReplicaId, int]:
        """Live sessions per replica (read-only by convention: the table owns it)."""
        return self._counts

    def place(self, key: SessionKey, replica: ReplicaId, now: float) -> None:
        """The session was (again) served on `replica` at `now`."""
        seen, counts = self._seen, self._counts
        old = seen.pop(key, None)
        if old is not None:
            counts[old[0]] -= 1
        seen[key] = (replica, now)
        counts[replica] = counts.get(replica, 0) + 1
        self.expire(now)

    def expire(self, now: float) -> None:
        seen, counts = self._seen, self._counts
        horizon = now - self.idle_s
        while seen:
            key, (replica, at) = next(iter(seen.items()))
            if at >= horizon and len(seen) <= self.max_sessions:
                break
            del seen[key]
            counts[replica] -= 1

    def forget(self, replica: ReplicaId) -> None:
        """The replica left: its sessions are placed afresh on their next request."""
        for key in [k for k, (r, _) in self._seen.items() if r == replica]:
            del self._seen[key]
        self._counts.pop(replica, None)
