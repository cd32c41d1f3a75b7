"""`LoopInbox`: calls a thread hands to the event loop, run in order, a slice at a time.

`call_soon_threadsafe` per call would do for a trickle, but the loop runs every callback
that is ready when an iteration starts before it looks at a socket again: a replay of an
engine's event history (thousands of batches posted at once) held the loop for 0.6 s per
replica, and every request in flight waited. The inbox runs queued calls until
`slice_s` has passed, then lets the loop poll its sockets before the next slice.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

# Long enough that one slice covers any single live batch (a new 20K-token prompt's
# 1250 blocks take about a millisecond), short enough that a request in flight never
# waits for more than a couple of them.
SLICE_S = 0.002


class LoopInbox:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        slice_s: float = SLICE_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._loop = loop
        self._slice_s = slice_s
        self._clock = clock
        self._calls: deque[tuple[Callable[..., None], tuple[object, ...]]] = deque()
        self._scheduled = False

    def __len__(self) -> int:
        return len(self._calls)

    def post(self, fn: Callable[..., None], *args: object) -> None:
        """From any thread. Dropped once the loop is closed (the service is stopping)."""
        self._calls.append((fn, args))
        if not self._scheduled:
            self._schedule(threadsafe=True)

    def _schedule(self, *, threadsafe: bool) -> None:
        self._scheduled = True
        loop = self._loop
        if loop.is_closed():
            return
        try:
            if threadsafe:
                loop.call_soon_threadsafe(self._drain)
            else:
                loop.call_soon(self._drain)
        except RuntimeError:  # the loop closed between the check and the call
            pass

    def _drain(self) -> None:
        calls = self._calls
        deadline = self._clock() + self._slice_s
        while calls:
            fn, args = calls.popleft()
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - as the loop does a callback: report, go on
                self._loop.call_exception_handler(
                    {"message": f"KV event call {fn!r} failed", "exception": exc}
                )
            if self._clock() >= deadline:
                break
        if calls:
            self._schedule(threadsafe=False)
            return
        self._scheduled = False
        # A post between the emptiness check and the flag's reset saw the flag still set
        # and scheduled nothing: look once more.
        if calls:
            self._schedule(threadsafe=False)
