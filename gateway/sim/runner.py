"""Drive an `EngineModel` in real time (scaled by the clock) for the HTTP server.

One task per engine runs `step -> sleep(duration) -> wake the requests that got tokens`.
With no work it waits on an event, so idle engines cost nothing. The `instant` profile
has no loop at all: a request runs to completion inside `submit`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from gateway.sim.clock import RealClock
from gateway.sim.engine import EngineModel, RequestHandle, SimRequest

log = logging.getLogger(__name__)

# While requests wait for blocks that only time can free (KV held for PD hand-off),
# re-check this often (real seconds).
_BLOCKED_POLL_S = 0.05


class EngineStopped(RuntimeError):
    pass


class EngineRunner:
    def __init__(self, model: EngineModel, clock: RealClock | None = None) -> None:
        self.model = model
        self.clock = clock or RealClock()
        self.instant = model.profile.instant
        self._wake = asyncio.Event()
        self._waiters: dict[RequestHandle, asyncio.Event] = {}
        self._task: asyncio.Task[None] | None = None
        self.error: BaseException | None = None
        # Called after every step's results went out (the KV event publisher's cue).
        self.on_deliver: Callable[[], None] | None = None

    def now(self) -> float:
        return self.clock.now()

    async def start(self) -> None:
        if self._task is None and not self.instant:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="sim-engine")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for handle in list(self._waiters):
            self.model.abort(handle, self.now())
        self._deliver()

    def submit(self, request: SimRequest) -> RequestHandle:
        """Queue a request (raises `RequestRejected`); pair with `stream` or `wait`."""
        if self.error is not None:
            raise EngineStopped("engine loop failed") from self.error
        handle = self.model.submit(request, self.now())
        self._waiters[handle] = asyncio.Event()
        if self.instant:
            self.model.run_to_completion(handle, self.now())
            self._deliver()
        else:
            self._wake.set()
        return handle

    def abort(self, handle: RequestHandle) -> bool:
        aborted = self.model.abort(handle, self.now())
        if aborted:
            self._deliver()
            self._wake.set()
        self._waiters.pop(handle, None)
        return aborted

    def release_held(self, request_id: str) -> tuple[int, tuple[int, ...]] | None:
        released = self.model.release_held(request_id)
        if released is not None:
            self._wake.set()
        return released

    async def stream(self, handle: RequestHandle) -> AsyncIterator[int]:
        """Yield the number of new output tokens each time some arrive, until finished.

        Callers abort the request if they stop early (e.g. the client went away).
        """
        event = self._waiters.get(handle)
        seen = 0
        try:
            while True:
                if handle.output_tokens > seen:
                    new, seen = handle.output_tokens - seen, handle.output_tokens
                    yield new
                if handle.finished:
                    return
                if event is None:
                    raise EngineStopped("request is not tracked by this runner")
                await event.wait()
                event.clear()
                if self.error is not None and not handle.finished:
                    raise EngineStopped("engine loop failed") from self.error
        finally:
            if handle.finished:
                self._waiters.pop(handle, None)

    async def wait(self, handle: RequestHandle) -> RequestHandle:
        async for _ in self.stream(handle):
            pass
        return handle

    def _deliver(self) -> None:
        if self.on_deliver is not None:
            self.on_deliver()
        for handle in self.model.take_updates():
            event = self._waiters.get(handle)
            if event is not None:
                event.set()

    async def _loop(self) -> None:
        model = self.model
        try:
            while True:
                self._wake.clear()
                duration = model.step(self.now())
                if duration > 0:
                    await self.clock.sleep(duration)
                    self._deliver()
                    continue
                self._deliver()
                blocked = model.has_work or bool(model.num_held)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), _BLOCKED_POLL_S if blocked else None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the boundary of the engine task: fail requests, log once
            log.exception("simulated engine loop failed")
            self.error = exc
            for event in self._waiters.values():
                event.set()
