"""`LoopInbox`: a thread's calls run on the loop in order, a slice at a time, so a flood of
them (an engine's replayed history) leaves the loop free to serve requests between slices."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from gateway.kvevents.inbox import LoopInbox


async def test_calls_from_a_thread_run_on_the_loop_in_order() -> None:
    loop = asyncio.get_running_loop()
    inbox = LoopInbox(loop)
    seen: list[tuple[int, bool]] = []
    done = asyncio.Event()
    on_loop = threading.get_ident()

    def call(i: int) -> None:
        seen.append((i, threading.get_ident() == on_loop))
        if i == 999:
            done.set()

    def producer() -> None:
        for i in range(1000):
            inbox.post(call, i)

    await asyncio.to_thread(producer)
    await asyncio.wait_for(done.wait(), 5)
    assert seen == [(i, True) for i in range(1000)]
    assert len(inbox) == 0


async def test_a_flood_of_calls_leaves_the_loop_running_between_slices() -> None:
    loop = asyncio.get_running_loop()
    inbox = LoopInbox(loop, slice_s=0.002)
    ran: list[int] = []

    def slow(i: int) -> None:
        time.sleep(0.0005)  # what applying one large batch costs the loop
        ran.append(i)

    for i in range(400):  # 0.2 s of work in all
        inbox.post(slow, i)
    # A timer due at once fires after one slice, long before the flood is through.
    woke = asyncio.Event()
    loop.call_soon(woke.set)
    await asyncio.wait_for(woke.wait(), 5)
    assert 0 < len(ran) < 40
    t0 = time.perf_counter()
    await asyncio.sleep(0.001)
    assert time.perf_counter() - t0 < 0.05
    while len(ran) < 400:
        await asyncio.sleep(0.01)
    assert ran == list(range(400))


async def test_a_failing_call_is_reported_and_the_rest_still_run() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
    try:
        inbox = LoopInbox(loop)
        ran: list[int] = []

        def call(i: int) -> None:
            if i == 1:
                raise ValueError("bad batch")
            ran.append(i)

        for i in range(3):
            inbox.post(call, i)
        for _ in range(100):
            if len(ran) == 2:
                break
            await asyncio.sleep(0.001)
        assert ran == [0, 2]
        assert isinstance(reported[0]["exception"], ValueError)
        # Still working afterwards.
        inbox.post(call, 3)
        await asyncio.sleep(0.01)
        assert ran == [0, 2, 3]
    finally:
        loop.set_exception_handler(None)


async def test_posts_after_the_loop_closed_are_dropped() -> None:
    loop = asyncio.new_event_loop()
    inbox = LoopInbox(loop)
    loop.close()
    inbox.post(print, "never")  # no RuntimeError from a stopping service's thread
    assert len(inbox) == 1
