"""Which conversations the gateway served lately, where they live, and why they moved."""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass

from gateway.types import ReplicaId, SessionKey

RECENT_MOVES = 50

# Why a conversation changed replica (the console's names for them).
FAILOVER = "failover"
POOL_WEIGHTS = "pool_weights"
BOUNDED_LOAD = "bounded_load"


@dataclass(slots=True)
class Session:
    replica: ReplicaId
    source: str
    first_seen: float
    last_seen: float
    requests: int = 0
    tokens: int = 0
    moves: int = 0


@dataclass(frozen=True, slots=True)
class Move:
    at: float  # wall clock
    key: SessionKey
    source: ReplicaId
    target: ReplicaId
    reason: str


class SessionTable:
    """A bounded LRU of sessions by last request; `seen` is O(1)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._map: OrderedDict[SessionKey, Session] = OrderedDict()
        self.moves: Counter[str] = Counter()
        self.recent_moves: deque[Move] = deque(maxlen=RECENT_MOVES)

    def __len__(self) -> int:
        return len(self._map)

    def seen(
        self, key: SessionKey, source: str, replica: ReplicaId, now: float, tokens: int
    ) -> ReplicaId | None:
        """Count one request of `key` served by `replica`; returns the replica it came from
        when the session moved (the caller says why with `moved`)."""
        entry = self._map.get(key)
        moved_from: ReplicaId | None = None
        if entry is None:
            entry = self._map[key] = Session(replica, source, now, now)
            if len(self._map) > self.capacity:
                self._map.popitem(last=False)
        else:
            self._map.move_to_end(key)
            if entry.replica != replica:
                moved_from = entry.replica
                entry.replica = replica
                entry.moves += 1
            entry.last_seen = now
        entry.requests += 1
        entry.tokens += tokens
        return moved_from

    def clear(self) -> None:
        self._map.clear()
        self.moves.clear()
        self.recent_moves.clear()

    def moved(self, move: Move) -> None:
        self.moves[move.reason] += 1
        self.recent_moves.append(move)

    def live(self, now: float, window_s: float) -> Iterator[tuple[SessionKey, Session]]:
        """Sessions seen in the last `window_s`, most recent first (stops at the first older)."""
        cutoff = now - window_s
        for key in reversed(self._map):
            entry = self._map[key]
            if entry.last_seen < cutoff:
                return
            yield key, entry
