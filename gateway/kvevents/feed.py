"""`EventFeed`: the loop side of the intake. Applies batches to the `EventIndex` and keeps
each replica's `SyncState` (which decides whether routing may trust its index)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.kvevents.delta import IndexDelta
from gateway.kvevents.index import EventIndex, SyncState
from gateway.kvevents.metrics import KVEventMetrics
from gateway.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from gateway.types import ReplicaId


@dataclass(slots=True)
class _Replica:
    state: SyncState = SyncState.DOWN
    # What the replica was before its publisher went away (restored when the stream resumes
    # with nothing missed).
    before_down: SyncState = SyncState.WARMING
    warming_since: float = 0.0
    last_batch_at: float = 0.0


class EventFeed:
    """Implements `FeedSink` (gateway.kvevents.intake); every method runs on the loop."""

    def __init__(
        self,
        index: EventIndex,
        metrics: KVEventMetrics | None = None,
        *,
        warmup_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.index = index
        self.metrics = metrics
        self.warmup_s = warmup_s
        self.clock = clock
        self.wall = wall
        self._replicas: dict[ReplicaId, _Replica] = {}

    def _r(self, replica: ReplicaId) -> _Replica:
        r = self._replicas.get(replica)
        if r is None:
            r = self._replicas[replica] = _Replica()
        return r

    def state(self, replica: ReplicaId) -> SyncState:
        r = self._replicas.get(replica)
        if r is None:
            return SyncState.DOWN
        if r.state is SyncState.WARMING and self.clock() - r.warming_since >= self.warmup_s:
            r.state = SyncState.SYNCED
        return r.state

    def states(self) -> dict[ReplicaId, SyncState]:
        return {rid: self.state(rid) for rid in self._replicas}

    def any_synced(self) -> bool:
        return any(self.state(rid) is SyncState.SYNCED for rid in self._replicas)

    def _set(self, replica: ReplicaId, r: _Replica, state: SyncState) -> None:
        if state is SyncState.WARMING and r.state is not SyncState.WARMING:
            r.warming_since = self.clock()
        r.state = state

    # -- FeedSink --------------------------------------------------------------------------
    def batch(self, replica: ReplicaId, seq: int, batch: EventBatch) -> None:
        self._flowing(replica)
        self.index.apply(replica, batch.events)
        m = self.metrics
        if m is not None:
            stored = removed = cleared = 0
            for e in batch.events:
                if isinstance(e, BlockStored):
                    stored += 1
                elif isinstance(e, BlockRemoved):
                    removed += 1
                elif isinstance(e, AllBlocksCleared):
                    cleared += 1
            m.batch(replica, stored, removed, cleared, max(0.0, self.wall() - batch.ts))

    def delta(self, replica: ReplicaId, seq: int, d: IndexDelta) -> None:
        """A batch the intake process applied to its own index (gateway.kvevents.remote)."""
        self._flowing(replica)
        self.index.apply_delta(replica, d)
        if self.metrics is not None:
            self.metrics.batch(replica, d.stored, d.removed, d.clears, max(0.0, self.wall() - d.ts))

    def _flowing(self, replica: ReplicaId) -> None:
        r = self._r(replica)
        if r.state is SyncState.DOWN:
            self._set(replica, r, r.before_down)
        r.last_batch_at = self.clock()

    def reset(self, replica: ReplicaId, complete: bool, reason: str) -> None:
        r = self._r(replica)
        self.index.clear(replica)
        self._set(replica, r, SyncState.SYNCED if complete else SyncState.WARMING)
        if self.metrics is not None:
            self.metrics.resync(replica, reason)

    def recovered(self, replica: ReplicaId, reason: str) -> None:
        r = self._r(replica)
        if r.state is SyncState.DOWN:
            self._set(replica, r, r.before_down)
        if self.metrics is not None:
            self.metrics.resync(replica, reason)

    def connection(self, replica: ReplicaId, up: bool) -> None:
        r = self._r(replica)
        if not up and r.state is not SyncState.DOWN:
            r.before_down = r.state
            r.state = SyncState.DOWN
        if self.metrics is not None:
            self.metrics.connection(replica, up)

    def gap(self, replica: ReplicaId, missed: int) -> None:
        if self.metrics is not None:
            self.metrics.gap(replica, missed)

    def malformed(self, replica: ReplicaId) -> None:
        if self.metrics is not None:
            self.metrics.malformed(replica)
