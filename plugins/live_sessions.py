"""Where each live conversation sits, and how many sit on each replica.

A session is live from its last request until `idle_s` later. The table is bounded
(`max_sessions`, least recently seen dropped first) and expires lazily, from the oldest
end, whenever it is touched: O(1) amortised per request, no timers.
"""

from __future__ import annotations

from collections import OrderedDict

from gateway.types import ReplicaId, SessionKey


class LiveSessions:
    __slots__ = ("_counts", "_seen", "_tokens", "idle_s", "max_sessions")

    def __init__(self, idle_s: float, max_sessions: int) -> None:
        self.idle_s = idle_s
        self.max_sessions = max(1, max_sessions)
        # key -> (replica, last seen, the session's last prompt tokens)
        self._seen: OrderedDict[SessionKey, tuple[ReplicaId, float, int]] = OrderedDict()
        self._counts: dict[ReplicaId, int] = {}
        self._tokens: dict[ReplicaId, int] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def replica_of(self, key: SessionKey, now: float) -> ReplicaId | None:
        entry = self._seen.get(key)
        if entry is None or now - entry[1] > self.idle_s:
            return None
        return entry[0]

    def seen(self, key: SessionKey, now: float) -> tuple[ReplicaId, float] | None:
        """The live session `key`'s replica and when it was last served, or None."""
        entry = self._seen.get(key)
        if entry is None or now - entry[1] > self.idle_s:
            return None
        return entry[0], entry[1]

    def last_seen(self, key: SessionKey, now: float) -> float | None:
        """When the live session `key` was last served, or None."""
        entry = self._seen.get(key)
        if entry is None or now - entry[1] > self.idle_s:
            return None
        return entry[1]

    def count(self, replica: ReplicaId) -> int:
        return self._counts.get(replica, 0)

    @property
    def counts(self) -> dict[ReplicaId, int]:
        """Live sessions per replica (read-only by convention: the table owns it)."""
        return self._counts

    @property
    def tokens(self) -> dict[ReplicaId, int]:
        """Per replica, the sum of its live sessions' latest prompt sizes: what their next
        turns will send, as a session's context only grows (read-only by convention)."""
        return self._tokens

    def place(self, key: SessionKey, replica: ReplicaId, now: float, tokens: int = 0) -> None:
        """The session was (again) served on `replica` at `now` with a `tokens` prompt."""
        seen, counts, weight = self._seen, self._counts, self._tokens
        old = seen.pop(key, None)
        if old is not None:
            counts[old[0]] -= 1
            weight[old[0]] -= old[2]
        seen[key] = (replica, now, tokens)
        counts[replica] = counts.get(replica, 0) + 1
        weight[replica] = weight.get(replica, 0) + tokens
        self.expire(now)

    def expire(self, now: float) -> None:
        seen, counts = self._seen, self._counts
        horizon = now - self.idle_s
        while seen:
            key, (replica, at, tokens) = next(iter(seen.items()))
            if at >= horizon and len(seen) <= self.max_sessions:
                break
            del seen[key]
            counts[replica] -= 1
            self._tokens[replica] -= tokens

    def forget(self, replica: ReplicaId) -> None:
        """The replica left: its sessions are placed afresh on their next request."""
        for key in [k for k, (r, _, _) in self._seen.items() if r == replica]:
            del self._seen[key]
        self._counts.pop(replica, None)
        self._tokens.pop(replica, None)
