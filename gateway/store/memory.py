"""MemoryStore: the embedded default. Everything lives in this process, no I/O at all.

It is also the local layer of `RedisStore`, which answers requests from it and replicates
it in the background, so the two share one implementation of TTLs and LRU bounds.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType

from gateway.store.base import Ejection, PrefixPlacement, PrefixSink, StoreStatus
from gateway.store.config import StoreSettings
from gateway.types import ReplicaId, SessionKey

Clock = Callable[[], float]


class MemoryStore:
    """Single-process `Store`. Session TTLs run on `clock`; ejections on `wall`."""

    backend = "memory"

    def __init__(
        self,
        settings: StoreSettings | None = None,
        *,
        clock: Clock = time.monotonic,
        wall: Clock = time.time,
        instance_id: str | None = None,
    ) -> None:
        self.settings = settings or StoreSettings()
        self.instance_id = instance_id or uuid.uuid4().hex[:12]
        self._clock = clock
        self._wall = wall
        # Insertion order == last-use order and the TTL is uniform, so the front of the dict
        # is always the next entry to expire: pruning is amortised O(1).
        self._sessions: OrderedDict[SessionKey, tuple[ReplicaId, float]] = OrderedDict()
        self._ejections: dict[ReplicaId, Ejection] = {}
        self._sinks: list[PrefixSink] = []
        # Responses chains: answer -> (root, expiry), in last-write order like sessions.
        self._roots: OrderedDict[str, tuple[str, float]] = OrderedDict()

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def sync(self) -> None:
        return None

    async def flushed(self) -> None:
        return None

    # -- sessions -------------------------------------------------------------------------
    async def lookup_session(self, session: SessionKey) -> ReplicaId | None:
        return self.local_lookup(session)

    async def assign_session(self, session: SessionKey, replica: ReplicaId) -> None:
        self.local_assign(session, replica)

    async def forget_replica(self, replica: ReplicaId) -> None:
        self.local_forget(replica)

    def local_lookup(self, session: SessionKey) -> ReplicaId | None:
        """Synchronous lookup that refreshes the TTL (the request-path fast path)."""
        self._prune_sessions()
        entry = self._sessions.get(session)
        if entry is None:
            return None
        self._sessions[session] = (entry[0], self._clock() + self.settings.session_ttl_s)
        self._sessions.move_to_end(session)
        return entry[0]

    def local_peek(self, session: SessionKey) -> ReplicaId | None:
        entry = self._sessions.get(session)
        if entry is None or entry[1] <= self._clock():
            return None
        return entry[0]

    def local_assign(
        self, session: SessionKey, replica: ReplicaId, ttl_s: float | None = None
    ) -> bool:
        """Place the session; returns True when this changed (or created) the placement."""
        ttl = (
            self.settings.session_ttl_s
            if ttl_s is None
            else min(ttl_s, self.settings.session_ttl_s)
        )
        previous = self._sessions.pop(session, None)
        self._sessions[session] = (replica, self._clock() + ttl)
        self._prune_sessions()
        while len(self._sessions) > self.settings.local_sessions_max:
            self._sessions.popitem(last=False)
        return previous is None or previous[0] != replica or previous[1] <= self._clock()

    def local_forget(self, replica: ReplicaId) -> int:
        gone = [s for s, (r, _) in self._sessions.items() if r == replica]
        for session in gone:
            del self._sessions[session]
        return len(gone)

    def local_sessions(self) -> Iterator[tuple[SessionKey, ReplicaId, float]]:
        """Live placements with their remaining TTL in seconds."""
        now = self._clock()
        for session, (replica, expires) in list(self._sessions.items()):
            if expires > now:
                yield session, replica, expires - now

    def _prune_sessions(self) -> None:
        now = self._clock()
        sessions = self._sessions
        while sessions:
            session, (_, expires) = next(iter(sessions.items()))
            if expires > now:
                break
            del sessions[session]

    # -- Responses chains -----------------------------------------------------------------
    async def link_response(self, response: str, root: str) -> None:
        self.local_link(response, root)

    async def response_root(self, response: str) -> str | None:
        return self.local_root(response)

    def local_link(self, response: str, root: str) -> None:
        roots = self._roots
        roots.pop(response, None)
        roots[response] = (root, self._clock() + self.settings.session_ttl_s)
        now = self._clock()
        while roots:
            first, (_, expires) = next(iter(roots.items()))
            if expires > now and len(roots) <= self.settings.local_sessions_max:
                break
            del roots[first]

    def local_root(self, response: str) -> str | None:
        entry = self._roots.get(response)
        if entry is None or entry[1] <= self._clock():
            return None
        return entry[0]

    # -- health and ejections -------------------------------------------------------------
    async def eject_replica(self, replica: ReplicaId, cooldown_s: float, reason: str = "") -> None:
        self.local_eject(Ejection(replica, self._wall() + cooldown_s, reason))

    async def readmit_replica(self, replica: ReplicaId) -> None:
        self._ejections.pop(replica, None)

    def local_eject(self, ejection: Ejection) -> None:
        current = self._ejections.get(ejection.replica)
        if current is None or current.until < ejection.until:
            self._ejections[ejection.replica] = ejection

    def local_readmit(self, replica: ReplicaId) -> None:
        self._ejections.pop(replica, None)

    def local_replace_ejections(self, ejections: Mapping[ReplicaId, Ejection]) -> None:
        self._ejections = dict(ejections)

    def now_wall(self) -> float:
        return self._wall()

    def ejections(self) -> Mapping[ReplicaId, Ejection]:
        now = self._wall()
        expired = [r for r, e in self._ejections.items() if e.until <= now]
        for replica in expired:
            del self._ejections[replica]
        return MappingProxyType(dict(self._ejections))

    # -- prefix placements ----------------------------------------------------------------
    def publish_prefix(self, placement: PrefixPlacement) -> None:
        # Nobody else shares this process's state; the local policy saw the placement already.
        return None

    def subscribe_prefixes(self, sink: PrefixSink) -> None:
        self._sinks.append(sink)

    def deliver_prefix(self, placement: PrefixPlacement) -> None:
        """Hand a placement made by another instance to every subscriber."""
        for sink in self._sinks:
            sink(placement)

    def status(self) -> StoreStatus:
        return StoreStatus(self.backend, False, len(self._sessions))
