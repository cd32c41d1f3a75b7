"""The waiting room: requests wait here while their replica is saturated.

One min-heap of waiters per replica, ordered by the fixed scores of
`gateway.admission.order`. A release pass for a replica hands out places, best score first,
for as long as `has_room(...)` says one more of that class and weight fits. When the best
waiter does not fit (its class is held back, or it is too heavy for now), the best waiter
of a *better* class that fits goes instead; waiters of its own or a lower class wait
behind it, so a heavy or aged request is never bypassed for ever by lighter ones. The one
exception is a bounded backfill: for the first `backfill_s` of a head's wait, lighter
waiters of its own class that fit may pass it (a long prompt waiting for the prompt-token
budget to drain does not stall every short one behind it); after that the head blocks. Passes run when a waiter
arrives, when the proxy reports that a request to the replica ended (`poke`), and on a
timer while anything waits (a fresh scrape may show room).

A released waiter holds a reservation (one request and its weight, e.g. prompt tokens)
until its task resumes; the caller must count the request as in flight before its next
`await`, so the reservation and the in-flight count never both lapse. Removal of a waiter is lazy (its heap entry is skipped later), so leaving
is O(1) whether by disconnect (task cancelled), timeout or eviction.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from gateway.admission.metrics import AdmissionMetrics
from gateway.errors import RateLimited
from gateway.types import ReplicaId

# has_room(replica, reserved requests, reserved weight, class name, weight of the candidate)
HasRoom = Callable[[ReplicaId, int, int, str, int], bool]


class _State(Enum):
    WAITING = 0
    RELEASED = 1
    GONE = 2


@dataclass(eq=False, slots=True)
class _Waiter:
    score: float
    replica: ReplicaId
    class_name: str
    class_rank: int
    weight: int
    enqueued_at: float
    future: asyncio.Future[None]
    state: _State = field(default=_State.WAITING)


class WaitingRoom:
    """Bounded by length (`max_queue`) and wait (`max_wait_s`); overflow answers 429."""

    def __init__(
        self,
        has_room: HasRoom,
        *,
        max_queue: int,
        max_wait_s: float,
        retry_after_s: float,
        recheck_interval_s: float,
        metrics: AdmissionMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        backfill_s: float = 0.0,
    ) -> None:
        self._has_room = has_room
        self._backfill_s = backfill_s
        self._max_queue = max_queue
        self._max_wait_s = max_wait_s
        self._retry_after_s = retry_after_s
        self._interval = recheck_interval_s
        self._metrics = metrics
        self._clock = clock
        self._heaps: dict[ReplicaId, list[tuple[float, int, _Waiter]]] = {}
        self._live: dict[ReplicaId, int] = {}
        self._reserved: dict[ReplicaId, int] = {}
        self._reserved_weight: dict[ReplicaId, int] = {}
        self._total = 0
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    # ---- queries -------------------------------------------------------------------
    def busy(self, replica: ReplicaId) -> bool:
        """Anyone waiting for `replica`? (A newcomer must not jump ahead of them.)"""
        return replica in self._live

    def reserved(self, replica: ReplicaId) -> int:
        return self._reserved.get(replica, 0)

    def __len__(self) -> int:
        return self._total

    # ---- waiting -------------------------------------------------------------------
    async def wait(
        self,
        replica: ReplicaId,
        score: float,
        class_name: str,
        weight: int = 0,
        class_rank: int = 0,
    ) -> float:
        """Wait for a place on `replica`; returns seconds waited.

        Raises `RateLimited` when the room is full (and this request ranks no better than
        the worst waiter) or the wait exceeds `max_wait_s`. Cancellation (a client that
        disconnected) leaves the room at once and gives back any place already granted.
        """
        if self._closed:
            raise RateLimited("gateway is shutting down", retry_after_s=self._retry_after_s)
        if self._total >= self._max_queue:
            self._make_room(score, class_name)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(
            score, replica, class_name, class_rank, weight, self._clock(), loop.create_future()
        )
        heapq.heappush(self._heaps.setdefault(replica, []), (score, next(self._seq), waiter))
        self._live[replica] = self._live.get(replica, 0) + 1
        self._total += 1
        if self._metrics is not None:
            self._metrics.queue_depth.labels(class_name).inc()
        self._release(replica)
        if waiter.state is _State.WAITING:
            self._arm_timer(loop)
        try:
            async with asyncio.timeout(self._max_wait_s):
                await waiter.future
        except TimeoutError:
            if waiter.state is _State.RELEASED:
                return self._resumed(waiter)
            if waiter.state is _State.GONE:
                # Evicted in the same instant the wait timed out: it already left the room
                # (leaving again would count it twice); its queue-full 429 stands.
                evicted = waiter.future.exception() if waiter.future.done() else None
                if isinstance(evicted, RateLimited):
                    raise evicted from None
            else:
                self._leave(waiter, "timeout")
            if self._metrics is not None:
                self._metrics.rejected.labels(class_name, "timeout").inc()
            raise RateLimited(
                f"waited {self._max_wait_s:g}s for a saturated replica; retry later",
                retry_after_s=self._retry_after_s,
            ) from None
        except asyncio.CancelledError:
            if waiter.state is _State.WAITING:
                self._leave(waiter, "disconnect")
            elif waiter.state is _State.RELEASED:
                self._give_back(waiter)
            elif waiter.future.done() and not waiter.future.cancelled():
                waiter.future.exception()  # evicted: mark the exception as retrieved
            raise
        return self._resumed(waiter)

    def _resumed(self, waiter: _Waiter) -> float:
        self._unreserve(waiter)
        waited = self._clock() - waiter.enqueued_at
        if self._metrics is not None:
            self._metrics.wait_seconds.labels(waiter.class_name, "released").observe(waited)
        return waited

    def _unreserve(self, waiter: _Waiter) -> None:
        replica = waiter.replica
        left = self._reserved[replica] - 1
        if left:
            self._reserved[replica] = left
            self._reserved_weight[replica] -= waiter.weight
        else:
            del self._reserved[replica]
            self._reserved_weight.pop(replica, None)

    def _give_back(self, waiter: _Waiter) -> None:
        self._unreserve(waiter)
        waiter.state = _State.GONE
        if self._metrics is not None:
            waited = self._clock() - waiter.enqueued_at
            self._metrics.wait_seconds.labels(waiter.class_name, "disconnect").observe(waited)
        self._release(waiter.replica)

    def _leave(self, waiter: _Waiter, outcome: str) -> None:
        waiter.state = _State.GONE
        self._forget(waiter)
        if self._metrics is not None:
            waited = self._clock() - waiter.enqueued_at
            self._metrics.wait_seconds.labels(waiter.class_name, outcome).observe(waited)

    def _forget(self, waiter: _Waiter) -> None:
        replica = waiter.replica
        left = self._live[replica] - 1
        if left:
            self._live[replica] = left
        else:
            del self._live[replica]
            self._heaps.pop(replica, None)
        self._total -= 1
        if self._metrics is not None:
            self._metrics.queue_depth.labels(waiter.class_name).dec()

    def _make_room(self, score: float, class_name: str) -> None:
        worst: _Waiter | None = None
        for heap in self._heaps.values():
            for _, _, w in heap:
                if (
                    w.state is _State.WAITING
                    and not w.future.done()  # cancelled, its task is about to leave
                    and (worst is None or w.score > worst.score)
                ):
                    worst = w
        if worst is None or worst.score <= score:
            if self._metrics is not None:
                self._metrics.rejected.labels(class_name, "queue_full").inc()
            raise RateLimited(
                f"admission queue full ({self._max_queue} waiting); retry later",
                retry_after_s=self._retry_after_s,
            )
        # The newcomer ranks better: the worst waiter is the one turned away.
        self._leave(worst, "evicted")
        if self._metrics is not None:
            self._metrics.rejected.labels(worst.class_name, "queue_full").inc()
        worst.future.set_exception(
            RateLimited(
                "admission queue full; a higher-ranked request took this place",
                retry_after_s=self._retry_after_s,
            )
        )

    # ---- releasing -----------------------------------------------------------------
    def poke(self, replica: ReplicaId) -> None:
        """Capacity may have freed on `replica` (a request ended): release who fits."""
        if replica in self._live:
            self._release(replica)

    def poke_all(self) -> None:
        for replica in list(self._live):
            self._release(replica)

    def _release(self, replica: ReplicaId) -> None:
        heap = self._heaps.get(replica)
        while heap:
            waiter = heap[0][2]
            if waiter.state is not _State.WAITING or waiter.future.done():
                heapq.heappop(heap)
                continue
            if self._fits(replica, waiter.class_name, waiter.weight):
                heapq.heappop(heap)
            else:
                found = self._best_with_room(replica, heap, waiter)
                if found is None:
                    return
                waiter = found
            waiter.state = _State.RELEASED
            self._reserved[replica] = self._reserved.get(replica, 0) + 1
            self._reserved_weight[replica] = self._reserved_weight.get(replica, 0) + waiter.weight
            self._forget(waiter)
            waiter.future.set_result(None)
            heap = self._heaps.get(replica)

    def _fits(self, replica: ReplicaId, class_name: str, weight: int) -> bool:
        return self._has_room(
            replica,
            self._reserved.get(replica, 0),
            self._reserved_weight.get(replica, 0),
            class_name,
            weight,
        )

    def _best_with_room(
        self, replica: ReplicaId, heap: list[tuple[float, int, _Waiter]], head: _Waiter
    ) -> _Waiter | None:
        """Best waiter that fits and may pass `head`: of a better class, or of its class and
        lighter while `head` is within its backfill window. O(queue), only when the head
        does not fit."""
        room: dict[tuple[str, int], bool] = {(head.class_name, head.weight): False}
        best: _Waiter | None = None
        backfill = self._backfill_s > 0 and self._clock() - head.enqueued_at < self._backfill_s
        for score, _, w in heap:
            if w.state is not _State.WAITING or w.future.done():
                continue
            if w.class_rank > head.class_rank or (
                w.class_rank == head.class_rank and not (backfill and w.weight < head.weight)
            ):
                continue
            if best is not None and score >= best.score:
                continue
            key = (w.class_name, w.weight)
            fits = room.get(key)
            if fits is None:
                fits = room[key] = self._fits(replica, w.class_name, w.weight)
            if fits:
                best = w
        # Its heap entry stays behind and is skipped once its state is no longer WAITING.
        return best

    def _arm_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is None:
            self._timer = loop.call_later(self._interval, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self.poke_all()
        if self._live and not self._closed:
            self._arm_timer(loop)

    def close(self) -> None:
        """Stop the timer and turn every waiter away (called from the app's shutdown)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for heap in list(self._heaps.values()):
            for _, _, w in heap:
                if w.state is _State.WAITING and not w.future.done():
                    self._leave(w, "shutdown")
                    w.future.set_exception(
                        RateLimited("gateway is shutting down", retry_after_s=self._retry_after_s)
                    )
