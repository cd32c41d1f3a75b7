"""Per replica, the prefill its still-active sessions will send: what each replica owes.

A session's next turn sends its own continued-turn prefill again (the tool output and
answer appended since its last turn, which its replica does not hold yet). This table
keeps, per session, the mean uncached prefill of its continued turns and the mean gap
between its turns, both measured from placements, and per replica the sum of that
prefill over the sessions still active there: ``owed[r]``, in tokens.

A session is active for ``ACTIVE_GAPS`` of its own mean gaps after its last turn (a
session with one turn so far uses the cluster's mean gap), capped at ``idle_s``; a
session that has not continued yet owes the cluster's mean continued turn. So a replica
carrying a few main agents that send 5K tokens every turn owes more than one carrying
many short chats, and a session that stopped (a finished chat, a subagent whose parent
resumed) stops counting a few of its gaps later, not after a fixed idle time.

Everything is incremental: a placement moves one session's contribution (O(1) plus a
heap push), and expiry pops from a heap of deadlines, lazily, whenever the table is
touched (O(log n) amortised per placement). No scan per decision.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

from gateway.types import ReplicaId, SessionKey

# A session counts as active this many of its own mean gaps between turns after its last
# turn (three: a turn later than that is rarer than a session that ended).
ACTIVE_GAPS = 3.0
# Smoothing of the cluster-wide means (per continued turn): the last few hundred weigh.
_CLUSTER_ALPHA = 0.02


@dataclass(slots=True)
class _Session:
    replica: ReplicaId
    last: float  # when its last turn was placed
    turns: int  # continued turns measured on its replica
    turn_tokens: float  # their mean uncached prefill
    gaps: int  # gaps between its turns measured
    gap_s: float  # their mean
    owed: float  # what it adds to its replica's sum now (0 once expired)
    deadline: float  # when it stops counting
    version: int  # of the heap entry that can expire it


class OwedPrefill:
    __slots__ = (
        "_deadlines",
        "_owed",
        "_sessions",
        "gap_s",
        "idle_s",
        "max_sessions",
        "turn_tokens",
    )

    def __init__(self, idle_s: float, max_sessions: int) -> None:
        self.idle_s = idle_s
        self.max_sessions = max(1, max_sessions)
        self._sessions: OrderedDict[SessionKey, _Session] = OrderedDict()
        self._owed: dict[ReplicaId, float] = {}
        self._deadlines: list[tuple[float, int, SessionKey]] = []
        # Cluster-wide means of a continued turn's uncached prefill and of the gap between
        # a session's turns; None until a session continued.
        self.turn_tokens: float | None = None
        self.gap_s: float | None = None

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def owed(self) -> dict[ReplicaId, float]:
        """Tokens each replica's active sessions will send next (read-only by convention)."""
        return self._owed

    @property
    def measured(self) -> bool:
        """A continued turn has been seen: the sums mean something."""
        return self.turn_tokens is not None

    def place(
        self, key: SessionKey, replica: ReplicaId, now: float, turn_tokens: float | None
    ) -> None:
        """The session `key` was served on `replica` at `now`; `turn_tokens` is this turn's
        uncached prefill when it continued the session on its own replica (else None: a
        first turn, or a move, whose prefill says nothing of its next turns)."""
        self.expire(now)
        sessions = self._sessions
        s = sessions.pop(key, None)
        if s is None:
            s = _Session(replica, now, 0, 0.0, 0, 0.0, 0.0, now, 0)
        else:
            self._take(s)
            gap = now - s.last
            s.gaps += 1
            s.gap_s += (gap - s.gap_s) / s.gaps
            self.gap_s = (
                gap if self.gap_s is None else self.gap_s + _CLUSTER_ALPHA * (gap - self.gap_s)
            )
            s.last = now
            s.replica = replica
        if turn_tokens is not None:
            s.turns += 1
            s.turn_tokens += (turn_tokens - s.turn_tokens) / s.turns
            mean = self.turn_tokens
            self.turn_tokens = (
                turn_tokens if mean is None else mean + _CLUSTER_ALPHA * (turn_tokens - mean)
            )
        s.owed = s.turn_tokens if s.turns else (self.turn_tokens or 0.0)
        gap_s = s.gap_s if s.gaps else self.gap_s
        window = self.idle_s if gap_s is None else min(self.idle_s, ACTIVE_GAPS * gap_s)
        s.deadline = now + window
        s.version += 1
        sessions[key] = s
        self._owed[replica] = self._owed.get(replica, 0.0) + s.owed
        heapq.heappush(self._deadlines, (s.deadline, s.version, key))
        while len(sessions) > self.max_sessions:
            _, old = sessions.popitem(last=False)
            self._take(old)

    def expire(self, now: float) -> None:
        """Sessions past their deadline stop counting (kept, for their gaps, until
        `idle_s` or the bound drops them)."""
        heap, sessions = self._deadlines, self._sessions
        while heap and heap[0][0] <= now:
            _, version, key = heapq.heappop(heap)
            s = sessions.get(key)
            if s is None or s.version != version:
                continue  # placed again since: a newer entry expires it
            self._take(s)
            if now - s.last > self.idle_s:
                del sessions[key]

    def _take(self, s: _Session) -> None:
        if not s.owed:
            return
        left = self._owed.get(s.replica, 0.0) - s.owed
        self._owed[s.replica] = left if left > 1e-6 else 0.0
        s.owed = 0.0

    def forget(self, replica: ReplicaId) -> None:
        """The replica left: its sessions are placed afresh on their next request."""
        for key in [k for k, s in self._sessions.items() if s.replica == replica]:
            del self._sessions[key]
        self._owed.pop(replica, None)
