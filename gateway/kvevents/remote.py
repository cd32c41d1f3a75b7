"""`RemoteIntake`: the KV event intake in a process of its own (`kv_events.intake: process`).

In a thread of the gateway, the intake's work shares the gateway's interpreter lock with the
event loop: a new 20K-token prompt arrives as a removal and a store of 1250 blocks each,
about 0.8 ms to decode in the intake thread and 1.2-1.3 ms to key and link on the loop.
Here a child process runs the same `EventIntake` (sockets, sequence checks, replays,
folding) and the whole `EventIndex`, and sends the gateway, per batch, only what changed for
lookups (gateway.kvevents.delta); the other calls of `FeedSink` (resets, connections,
gaps) are forwarded as they are. The loop's share of such a batch is then 0.24-0.30 ms. On
a 2-core machine shared with the engines the child's CPU raised the request path's median
and lowered its p99 (docs/kvevents.md), hence opt-in.

A reader thread receives the messages and hands them to the loop through a `LoopInbox`, in
order. If the child dies, every replica is marked down (routing falls back to the
approximate index), and a new child is started after `restart_s`; it joins each engine's
stream afresh (replay, or clear and warm), as a restarted gateway would.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Protocol

from gateway.kvevents.delta import IndexDelta, apply_tracked
from gateway.kvevents.inbox import LoopInbox
from gateway.kvevents.index import EventIndex
from gateway.kvevents.intake import EventIntake, Source
from gateway.kvevents.wire import EventBatch
from gateway.types import ReplicaId

log = logging.getLogger("kvgate.kvevents")

RESTART_S = 1.0


class DeltaSink(Protocol):
    """The loop side (`EventFeed`): `FeedSink` with batches as deltas."""

    def delta(self, replica: ReplicaId, seq: int, d: IndexDelta) -> None: ...

    def reset(self, replica: ReplicaId, complete: bool, reason: str) -> None: ...

    def recovered(self, replica: ReplicaId, reason: str) -> None: ...

    def connection(self, replica: ReplicaId, up: bool) -> None: ...

    def gap(self, replica: ReplicaId, missed: int) -> None: ...

    def malformed(self, replica: ReplicaId) -> None: ...


# -- the child process -----------------------------------------------------------------


class _Forward:
    """`FeedSink` in the child: applies batches to its whole index, sends the deltas."""

    def __init__(self, out: Connection, index: EventIndex) -> None:
        self.out = out
        self.index = index

    def batch(self, replica: ReplicaId, seq: int, batch: EventBatch) -> None:
        self.out.send(
            ("delta", replica, seq, apply_tracked(self.index, replica, batch.events, batch.ts))
        )

    def reset(self, replica: ReplicaId, complete: bool, reason: str) -> None:
        self.index.clear(replica)
        self.out.send(("reset", replica, complete, reason))

    def recovered(self, replica: ReplicaId, reason: str) -> None:
        self.out.send(("recovered", replica, reason))

    def connection(self, replica: ReplicaId, up: bool) -> None:
        self.out.send(("connection", replica, up))

    def gap(self, replica: ReplicaId, missed: int) -> None:
        self.out.send(("gap", replica, missed))

    def malformed(self, replica: ReplicaId) -> None:
        self.out.send(("malformed", replica))


def _until_told(control: Connection) -> None:
    """Returns on "stop", or when the gateway is gone (its end of the pipe closed)."""
    try:
        control.recv()
    except (EOFError, OSError):
        pass


async def _serve(intake: EventIntake, control: Connection) -> None:
    await intake.start()
    try:
        await asyncio.to_thread(_until_told, control)
    finally:
        await intake.stop()


def child_main(
    out: Connection,
    control: Connection,
    sources: tuple[Source, ...],
    timeout_s: float,
    max_blocks: int,
    block_size: int | None = None,
) -> None:
    """The child's entry point (spawned: it shares nothing with the gateway but the pipes)."""
    try:
        sink = _Forward(out, EventIndex(max_blocks))
        intake = EventIntake(sources, sink, replay_timeout_s=timeout_s, block_size=block_size)
        asyncio.run(_serve(intake, control))
    except (BrokenPipeError, EOFError, KeyboardInterrupt):
        pass  # the gateway went away


# -- the gateway side ------------------------------------------------------------------


class RemoteIntake:
    """A `Service`: `start()` spawns the child and the reader thread, `stop()` ends both."""

    def __init__(
        self,
        sources: tuple[Source, ...],
        sink: DeltaSink,
        *,
        replay_timeout_s: float = 1.0,
        max_blocks: int = 1 << 21,
        block_size: int | None = None,
        restart_s: float = RESTART_S,
        on_restart: Callable[[], None] | None = None,
    ) -> None:
        self.sources = sources
        self.sink = sink
        self.replay_timeout_s = replay_timeout_s
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.restart_s = restart_s
        self.on_restart = on_restart
        self.restarts = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._proc: BaseProcess | None = None
        self._data: Connection | None = None
        self._control: Connection | None = None
        self._reader: threading.Thread | None = None
        self._inbox: LoopInbox | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> None:
        if self._reader is not None or not self.sources:
            return
        self._inbox = LoopInbox(asyncio.get_running_loop())
        self._stopping.clear()
        await asyncio.to_thread(self._spawn)
        self._reader = threading.Thread(target=self._read, name="kvgate-kv-events", daemon=True)
        self._reader.start()

    def _spawn(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        data_r, data_w = ctx.Pipe(duplex=False)
        control_r, control_w = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=child_main,
            args=(
                data_w,
                control_r,
                self.sources,
                self.replay_timeout_s,
                self.max_blocks,
                self.block_size,
            ),
            name="kvgate-kv-events",
            daemon=True,
        )
        proc.start()
        data_w.close()
        control_r.close()
        with self._lock:
            self._proc, self._data, self._control = proc, data_r, control_w

    def _read(self) -> None:
        while not self._stopping.is_set():
            data = self._data
            assert data is not None
            try:
                message = data.recv()
            except (EOFError, OSError):
                if self._stopping.is_set():
                    return
                self._lost()
                continue
            self._post(message)

    def _lost(self) -> None:
        """The child died: routing falls back to the approximate index until a new one
        has joined the streams again."""
        log.warning("KV event intake process exited; starting another in %.1f s", self.restart_s)
        for source in self.sources:
            self._post(("connection", source.stream, False))
        old, data, control = self._proc, self._data, self._control
        if old is not None:
            old.join(1.0)
        for pipe in (data, control):
            if pipe is not None:
                pipe.close()
        if self._stopping.wait(self.restart_s):
            return
        self.restarts += 1
        if self.on_restart is not None:
            self.on_restart()
        self._spawn()
        if self._stopping.is_set():  # stop() ran meanwhile and ended the child before this one
            self._end_child()

    def _post(self, message: tuple[object, ...]) -> None:
        if self._inbox is not None:
            self._inbox.post(self._deliver, message)

    def _deliver(self, message: tuple[object, ...]) -> None:
        kind, *args = message
        getattr(self.sink, str(kind))(*args)

    async def stop(self) -> None:
        reader, self._reader = self._reader, None
        if reader is None:
            return
        self._stopping.set()
        await asyncio.to_thread(self._end_child)
        # The child's end of the data pipe is closed now: the reader sees the end and returns.
        await asyncio.to_thread(reader.join, 5.0)
        if self._data is not None:
            self._data.close()

    def _end_child(self) -> None:
        with self._lock:
            proc, control = self._proc, self._control
        if control is not None:
            try:
                control.send("stop")
            except OSError:
                pass
            control.close()
        if proc is not None:
            proc.join(5.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
