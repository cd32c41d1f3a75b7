"""One worker's part of the shared `/metrics` (a `Service` on the gateway's state).

Every `SNAPSHOT_INTERVAL_S` the worker writes its scrape-time series to
`kvgate_live_<pid>.json` in the shared directory (gateway.workers.snapshot). The worker a
scrape reaches answers with prometheus-client's `MultiProcessCollector` over every
worker's metric files plus the merge of its own series (taken now) with the other
workers' snapshots. A worker that is gone (its process no longer exists) is forgotten:
its snapshot and its `live*` gauge files are removed (`mark_process_dead`); its counters
and histograms stay, as totals must. A snapshot older than `STALE_AFTER_S` (a worker that
hangs) is left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from gateway.metrics import GatewayRegistry
from gateway.workers.snapshot import MergedCollector, Snapshot, decode, encode, take

log = logging.getLogger("kvgate.workers")

SNAPSHOT_INTERVAL_S = 1.0
STALE_AFTER_S = 5.0
SNAPSHOT_PREFIX = "kvgate_live_"
SNAPSHOT_SUFFIX = ".json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_atomic(path: Path, data: bytes) -> None:
    # A reader never sees half a file: write beside it, then rename over it.
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class WorkerMetrics:
    def __init__(
        self,
        registry: GatewayRegistry,
        directory: Path,
        *,
        interval_s: float = SNAPSHOT_INTERVAL_S,
        stale_after_s: float = STALE_AFTER_S,
        clock: Callable[[], float] = time.time,
        pid: int | None = None,
    ) -> None:
        self._registry = registry
        self._dir = directory
        self._interval_s = interval_s
        self._stale_after_s = stale_after_s
        self._clock = clock
        self.pid = pid if pid is not None else os.getpid()
        self.path = directory / f"{SNAPSHOT_PREFIX}{self.pid}{SNAPSHOT_SUFFIX}"
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.write()
        self._task = asyncio.create_task(self._run(), name="kvgate-worker-metrics")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._forget(self.pid)

    async def write(self) -> None:
        """Write this worker's snapshot now (collected here, written off the loop)."""
        data = encode(self.take())
        await asyncio.to_thread(_write_atomic, self.path, data)

    def take(self) -> Snapshot:
        return take(self._registry.live_collectors(), self.pid, self._clock())

    async def exposition(self) -> bytes:
        """What GET /metrics answers: every worker's series, merged."""
        own = self.take()
        return await asyncio.to_thread(self.render, own)

    def render(self, own: Snapshot) -> bytes:
        registry = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(registry, path=str(self._dir))  # type: ignore[no-untyped-call]
        registry.register(MergedCollector([own, *self.others(own.time)]))
        return generate_latest(registry)

    def others(self, now: float) -> list[Snapshot]:
        """The other live workers' fresh snapshots; forgets the workers that are gone."""
        out: list[Snapshot] = []
        seen: set[int] = {self.pid}
        for path in self._dir.glob(f"{SNAPSHOT_PREFIX}*{SNAPSHOT_SUFFIX}"):
            pid = _pid_of(path.name[len(SNAPSHOT_PREFIX) : -len(SNAPSHOT_SUFFIX)])
            if pid is None or pid in seen:
                continue
            seen.add(pid)
            if not _alive(pid):
                self._forget(pid)
                continue
            try:
                snapshot = decode(path.read_bytes())
            except FileNotFoundError:  # the worker stopped between the glob and the read
                continue
            if snapshot is not None and now - snapshot.time <= self._stale_after_s:
                out.append(snapshot)
        # Gauges of a worker that died before writing its first snapshot.
        for path in self._dir.glob("gauge_live*.db"):
            pid = _pid_of(path.stem.rpartition("_")[2])
            if pid is not None and pid not in seen and not _alive(pid):
                seen.add(pid)
                self._forget(pid)
        return out

    def _forget(self, pid: int) -> None:
        path = self._dir / f"{SNAPSHOT_PREFIX}{pid}{SNAPSHOT_SUFFIX}"
        path.unlink(missing_ok=True)
        mark_process_dead(pid, str(self._dir))  # type: ignore[no-untyped-call]
        if pid != self.pid:
            log.info("worker %d is gone: its gauges left /metrics", pid)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.write()
            except OSError as exc:
                log.warning("writing this worker's metrics snapshot failed: %s", exc)


def _pid_of(text: str) -> int | None:
    return int(text) if text.isdigit() else None
