"""Noticing that the client left: race ASGI `receive()` for `http.disconnect`.

Polling `is_disconnected()` misses disconnects once middleware wraps `receive`, and
awaiting only the upstream would keep an engine generating for nobody. Instead a watcher
task waits on `receive()` and cancels the request's task the moment the client goes; the
request's `finally` blocks then close the upstream connection (so the engine aborts).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


class CallState:
    """Per-request bookkeeping shared between the handler and its disconnect watcher."""

    __slots__ = ("active", "disconnected", "request_id", "started", "task", "ttfb", "watcher")

    def __init__(self, task: asyncio.Task[Any] | None) -> None:
        self.task = task
        self.watcher: asyncio.Future[bool] | None = None
        self.active = True  # cleared when the handler returns: late callbacks do nothing
        self.disconnected = False
        self.started = False  # the response start went to the client
        self.ttfb: float | None = None
        self.request_id = b""  # returned as X-Request-Id on whatever response goes out

    def on_watch_done(self, watcher: asyncio.Future[bool]) -> None:
        if watcher.cancelled() or not self.active or self.task is None:
            return
        if watcher.exception() is None and watcher.result():
            self.disconnected = True
            self.task.cancel()

    def watch(self, receive: Receive) -> None:
        self.watcher = asyncio.ensure_future(wait_disconnect(receive))
        self.watcher.add_done_callback(self.on_watch_done)

    def stop_watching(self) -> None:
        # Before the last body message: uvicorn reports http.disconnect once a response is
        # complete, which must not be mistaken for the client leaving.
        if self.watcher is not None:
            self.watcher.cancel()


async def wait_disconnect(receive: Receive) -> bool:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return True
