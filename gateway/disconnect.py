"""Noticing that the client left: race ASGI `receive()` for `http.disconnect`.

Polling `is_disconnected()` misses disconnects once middleware wraps `receive`, and
awaiting only the upstream would keep an engine generating for nobody. Instead a watcher
waits on `receive()` and cancels the request's task the moment the client goes; the
request's `finally` blocks then close the upstream connection (so the engine aborts).

The watcher is not an asyncio Task: a Task per request costs its creation, registration,
a scheduled first step, a CancelledError thrown into it at the end and a scheduled done
callback. `_Watcher` steps the `wait_disconnect` coroutine itself from the done callbacks
of the futures it awaits (what a Task does, without the rest), and `close()` finalises it
synchronously. Its first step is deferred with `call_soon`, so it runs once the handler
waits for the engine rather than before the request goes out.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from gateway.asgi import Receive

log = logging.getLogger("kvgate.disconnect")


class _Watcher:
    """Runs one coroutine to completion without a Task; `on_result` gets its return value."""

    __slots__ = ("_context", "_coro", "_loop", "_on_result", "_waiting")

    def __init__(
        self,
        coro: Coroutine[Any, Any, bool],
        on_result: Callable[[bool], None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._coro: Coroutine[Any, Any, bool] | None = coro
        self._on_result = on_result
        self._loop = loop
        self._waiting: asyncio.Future[Any] | None = None
        # One context for every step, as a Task would have.
        self._context = contextvars.copy_context()
        loop.call_soon(self._step, context=self._context)

    def _step(self, _done: object = None) -> None:
        self._waiting = None
        coro = self._coro
        if coro is None:  # closed while a step was already scheduled
            return
        try:
            awaited = coro.send(None)
        except StopIteration as stop:
            self._coro = None
            self._on_result(bool(stop.value))
            return
        except (Exception, asyncio.CancelledError):
            # receive() itself failed: that says nothing about the client; the request
            # goes on (a broken connection shows up on the next send).
            self._coro = None
            log.debug("disconnect watcher stopped on an error", exc_info=True)
            return
        if awaited is None:
            # A bare yield (asyncio.sleep(0)): resume on the next loop iteration.
            self._loop.call_soon(self._step, context=self._context)
            return
        awaited.add_done_callback(self._step, context=self._context)
        self._waiting = awaited

    def close(self) -> None:
        coro = self._coro
        if coro is None:
            return
        self._coro = None
        waiting = self._waiting
        if waiting is not None:
            self._waiting = None
            waiting.remove_done_callback(self._step)
        coro.close()


class CallState:
    """Per-request bookkeeping shared between the handler and its disconnect watcher."""

    __slots__ = (
        "active",
        "disconnected",
        "request_id",
        "started",
        "task",
        "ttfb",
        "watcher",
        "watching",
    )

    def __init__(self, task: asyncio.Task[Any] | None) -> None:
        self.task = task
        self.watcher: _Watcher | None = None
        self.watching = False  # a disconnect now cancels the task
        self.active = True  # cleared when the handler returns: late callbacks do nothing
        self.disconnected = False
        self.started = False  # the response start went to the client
        self.ttfb: float | None = None
        self.request_id = b""  # returned as X-Request-Id on whatever response goes out

    def on_receive_done(self, client_left: bool) -> None:
        if client_left and self.watching and self.active and self.task is not None:
            self.disconnected = True
            self.task.cancel()

    def watch(self, receive: Receive) -> None:
        self.watching = True
        task = self.task
        # The task's own loop: asyncio.get_running_loop() makes a getpid() syscall each time.
        loop = task.get_loop() if task is not None else asyncio.get_running_loop()
        self.watcher = _Watcher(wait_disconnect(receive), self.on_receive_done, loop)

    def stop_watching(self) -> None:
        # Before the last body message: uvicorn reports http.disconnect once a response is
        # complete, which must not be mistaken for the client leaving. Only a flag here,
        # as the response's last byte is waiting; `close_watcher()` tidies up after it.
        self.watching = False

    def close_watcher(self) -> None:
        self.watching = False
        watcher = self.watcher
        if watcher is not None:
            self.watcher = None
            watcher.close()


async def wait_disconnect(receive: Receive) -> bool:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return True
