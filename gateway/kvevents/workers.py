"""Where the tokenizer stage's jobs run: threads of the gateway, or worker processes.

A job renders a prompt, tokenizes it and keys its token blocks (`run_job`). In a thread it
shares the gateway's renderer and token cache, but it holds the GIL while it works, and
the event loop, relaying other requests meanwhile, waits for it: a Hugging Face
tokenizer's `encode` never lets go of the GIL, so a 100K-token prompt tokenized whole
stops every other thread of the gateway for a quarter of a second.

`ProcessJobs` runs jobs in worker processes (`python -m gateway.kvevents.worker`), each
with its own renderer and token cache built from the settings when it starts. The loop
itself writes each job to the worker's stdin and reads results from its stdout, as
length-prefixed pickles, with no thread in between (a thread would cost GIL hand-offs on
every job). A job goes to the worker its key picks (the request's session key), so the
turns of one conversation find their earlier turn in that worker's token cache.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gateway.errors import ConfigError
from gateway.kvevents.config import TokenizerKind, TokenizerSettings
from gateway.kvevents.learn import Learnt, learn_rendered
from gateway.kvevents.render import HFRenderer, Renderer, SimRenderer, TokenIdsOnly
from gateway.kvevents.tokcache import CacheStats, TokenCache
from gateway.types import Endpoint

log = logging.getLogger("kvgate.kvevents")

# (what was learnt, seconds, the token cache's answer, tokens it gave, the cache's size)
JobResult = tuple[Learnt | None, float, str, int, CacheStats | None]
# A frame: its length (8 bytes, little-endian), then a pickle.
HEADER_BYTES = 8
START_TIMEOUT_S = 60.0


def frame(obj: object) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(HEADER_BYTES, "little") + data


class WorkerFailed(RuntimeError):
    """A job's worker process raised, or died before answering."""


def make_cache(settings: TokenizerSettings) -> TokenCache | None:
    if settings.cache_entries == 0 or settings.cache_bytes == 0:
        return None
    return TokenCache(settings.cache_entries, settings.cache_bytes)


def make_renderer(
    settings: TokenizerSettings, cache: TokenCache | None = None, block_size: int = 16
) -> Renderer:
    if settings.kind is TokenizerKind.SIM:
        return SimRenderer(cache, block_size)
    if settings.kind is TokenizerKind.HF:
        assert settings.path is not None
        template = None
        try:
            if settings.chat_template:
                template = Path(settings.chat_template).read_text()
            specials = {"bos_token": settings.bos_token, "eos_token": settings.eos_token}
            return HFRenderer(settings.path, template, specials, cache, block_size)
        except (OSError, ValueError, ImportError) as exc:
            raise ConfigError(
                f"cannot load the tokenizer: {exc}", param="kv_events.tokenizer"
            ) from exc
    return TokenIdsOnly()


def run_job(
    renderer: Renderer,
    cache: TokenCache | None,
    body: Mapping[str, Any],
    endpoint: Endpoint,
    hashes: Sequence[int],
    block_bytes: int,
    block_size: int,
) -> JobResult:
    t0 = time.perf_counter()
    rendered = renderer.render(body, endpoint)
    stats = cache.stats() if cache is not None else None  # learning leaves the cache be
    if rendered is None:
        return None, time.perf_counter() - t0, "", 0, stats
    learnt = learn_rendered(rendered, hashes, block_bytes, block_size)
    return learnt, time.perf_counter() - t0, rendered.reuse, rendered.reused, stats


class _Proc:
    """One worker process and the jobs it has not answered yet (it answers in order)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.waiting: deque[asyncio.Future[JobResult]] = deque()
        self.reader: asyncio.Task[None] | None = None
        self.alive = True
        self.exited: asyncio.Event = asyncio.Event()

    async def read_frame(self) -> Any:
        assert self.proc.stdout is not None
        size = int.from_bytes(await self.proc.stdout.readexactly(HEADER_BYTES), "little")
        return pickle.loads(await self.proc.stdout.readexactly(size))

    async def read_results(self) -> None:
        try:
            while True:
                kind, value = await self.read_frame()
                if not self.waiting:  # an answer to no job: the stream is out of step
                    raise ValueError(f"unexpected {kind!r} frame")
                future = self.waiting.popleft()
                if future.done():  # cancelled meanwhile (the stage stopped)
                    continue
                if kind == "ok":
                    future.set_result(value)
                else:
                    future.set_exception(WorkerFailed(value))
        except (
            asyncio.IncompleteReadError,
            ConnectionError,
            pickle.UnpicklingError,
            EOFError,
            ValueError,
            TypeError,
        ) as exc:
            # Its answers can no longer be matched to jobs: the worker is done for.
            self.fail(f"the tokenizer worker exited or garbled its answers ({exc!r})")
            if self.proc.returncode is None:
                self.proc.kill()
            self.exited.set()

    def fail(self, why: str) -> None:
        self.alive = False
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(WorkerFailed(why))


class ProcessJobs:
    """`workers` worker processes; a job runs in the one its key picks. A worker that dies
    fails the jobs it held (the stage counts them as errors and routes without them) and is
    started again after `restart_delay_s`; meanwhile its jobs go to the others, or fail."""

    def __init__(
        self,
        settings: TokenizerSettings,
        block_size: int,
        workers: int = 1,
        restart_delay_s: float = 1.0,
        on_restart: Callable[[], object] | None = None,
    ) -> None:
        self.settings = settings
        self.block_size = block_size
        self.workers = max(1, workers)
        self.restart_delay_s = restart_delay_s
        self.restarts = 0
        self._on_restart = on_restart
        self._procs: list[_Proc] = []
        self._watchers: list[asyncio.Task[None]] = []
        self._stopping = False

    @property
    def running(self) -> bool:
        """Started and not stopped (its workers may be restarting meanwhile)."""
        return bool(self._procs) and not self._stopping

    async def start(self) -> None:
        """Start the workers and wait until each has built its renderer (an interpreter and
        the tokenizer: a few hundred ms), so that no request waits for that."""
        self._stopping = False
        try:
            for slot in range(self.workers):
                self._procs.append(await self._spawn())
                self._watchers.append(asyncio.create_task(self._watch(slot)))
        except (OSError, asyncio.IncompleteReadError, TimeoutError, pickle.UnpicklingError) as exc:
            await self.stop()
            raise ConfigError(
                f"the tokenizer worker did not start: {exc!r}", param="kv_events.tokenizer"
            ) from exc

    async def _spawn(self) -> _Proc:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gateway.kvevents.worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        worker = _Proc(proc)
        assert proc.stdin is not None
        proc.stdin.write(frame((self.settings.model_dump(mode="json"), self.block_size)))
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                kind, value = await worker.read_frame()
        except BaseException:
            proc.kill()
            await proc.wait()
            raise
        if kind != "ready":
            proc.kill()
            await proc.wait()
            raise OSError(f"tokenizer worker: {value}")
        worker.reader = asyncio.create_task(worker.read_results(), name="kvgate-tokenize-read")
        return worker

    async def _watch(self, slot: int) -> None:
        """Start the worker of `slot` again whenever it exits, until the stage stops."""
        while not self._stopping:
            await self._procs[slot].exited.wait()
            await asyncio.sleep(self.restart_delay_s)
            if self._stopping:
                return
            try:
                self._procs[slot] = await self._spawn()
            except (
                OSError,
                asyncio.IncompleteReadError,
                TimeoutError,
                pickle.UnpicklingError,
            ) as exc:
                log.warning("tokenizer worker %d did not start again: %r", slot, exc)
                continue
            self.restarts += 1
            if self._on_restart is not None:
                self._on_restart()
            log.warning("tokenizer worker %d exited; started again", slot)

    async def stop(self) -> None:
        self._stopping = True
        watchers, self._watchers = self._watchers, []
        for watcher in watchers:
            watcher.cancel()
        procs, self._procs = self._procs, []
        for worker in procs:
            worker.fail("the tokenizer stage stopped")
            stdin = worker.proc.stdin
            if stdin is not None and not stdin.is_closing():
                stdin.close()  # the worker exits at the end of its input
        for worker in procs:
            try:
                async with asyncio.timeout(5.0):
                    await worker.proc.wait()
            except TimeoutError:
                worker.proc.kill()
                await worker.proc.wait()
            if worker.reader is not None:
                worker.reader.cancel()

    def submit(
        self,
        key: int,
        body: Mapping[str, Any],
        endpoint: Endpoint,
        hashes: Sequence[int],
        block_bytes: int,
    ) -> asyncio.Future[JobResult]:
        """Hand a job to its worker; never blocks (the pipe's buffer takes what the worker
        has not read yet, bounded by the stage's `max_pending` jobs)."""
        future: asyncio.Future[JobResult] = asyncio.get_running_loop().create_future()
        live = [w for w in self._procs if w.alive]
        worker = live[key % len(live)] if live else None
        stdin = worker.proc.stdin if worker is not None else None
        if worker is None or stdin is None or stdin.is_closing():
            future.set_exception(WorkerFailed("no tokenizer worker is running"))
            return future
        worker.waiting.append(future)
        stdin.write(frame((dict(body), endpoint.value, tuple(hashes), block_bytes)))
        return future
