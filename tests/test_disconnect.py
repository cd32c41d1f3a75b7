"""The disconnect watcher (gateway.disconnect) on its own, with hand-driven ASGI receives.

End to end (real servers, real engines aborting) is tests/proxy/test_proxy_disconnect.py; this
pins the watcher's own contract: a disconnect cancels the request's task, one arriving after
`stop_watching()` does not, and closing leaves nothing pending.
"""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

import pytest

from gateway.disconnect import CallState


class ScriptedReceive:
    """An ASGI receive whose messages the test releases one by one."""

    def __init__(self, *, bare_yield: bool = False) -> None:
        self.queue: asyncio.Queue[MutableMapping[str, Any]] = asyncio.Queue()
        self.calls = 0
        self.bare_yield = bare_yield

    async def __call__(self) -> MutableMapping[str, Any]:
        self.calls += 1
        if self.bare_yield:
            await asyncio.sleep(0)  # yields None to whoever drives the coroutine
        return await self.queue.get()


async def _handler(call: CallState, receive: ScriptedReceive, started: asyncio.Event) -> str:
    call.watch(receive)
    started.set()
    try:
        await asyncio.sleep(5)
        return "finished"
    except asyncio.CancelledError:
        return "cancelled" if call.disconnected else "cancelled by someone else"
    finally:
        call.active = False
        call.close_watcher()


async def _run(
    receive: ScriptedReceive, *messages: MutableMapping[str, Any]
) -> tuple[CallState, str]:
    started = asyncio.Event()
    call = CallState(None)
    task = asyncio.create_task(_handler(call, receive, started))
    call.task = task
    await started.wait()
    for message in messages:
        receive.queue.put_nowait(message)
        await asyncio.sleep(0.01)
    if not task.done():
        task.cancel()  # end the test's handler; not a disconnect
    return call, await task


@pytest.mark.parametrize("bare_yield", [False, True])
async def test_disconnect_cancels_the_request(bare_yield: bool) -> None:
    receive = ScriptedReceive(bare_yield=bare_yield)
    call, outcome = await _run(
        receive,
        {"type": "http.request", "body": b"", "more_body": False},
        {"type": "http.disconnect"},
    )
    assert outcome == "cancelled"
    assert call.disconnected
    assert receive.calls == 2  # kept receiving past the non-disconnect message


async def test_disconnect_after_stop_watching_is_ignored() -> None:
    receive = ScriptedReceive()
    started = asyncio.Event()
    call = CallState(None)

    async def handler() -> str:
        call.watch(receive)
        started.set()
        await asyncio.sleep(0.01)
        call.stop_watching()  # the response's last message is about to go out
        receive.queue.put_nowait({"type": "http.disconnect"})  # what uvicorn reports then
        await asyncio.sleep(0.01)
        call.active = False
        call.close_watcher()
        return "finished"

    task = asyncio.create_task(handler())
    call.task = task
    assert await task == "finished"
    assert not call.disconnected


async def test_close_before_the_first_step_leaves_nothing_pending() -> None:
    receive = ScriptedReceive()
    call = CallState(asyncio.current_task())
    call.watch(receive)
    call.close_watcher()
    await asyncio.sleep(0.01)
    assert receive.calls == 0
    assert not call.disconnected


async def test_closing_a_waiting_watcher_releases_its_receive() -> None:
    receive = ScriptedReceive()
    call = CallState(asyncio.current_task())
    call.watch(receive)
    await asyncio.sleep(0.01)
    assert receive.calls == 1
    call.close_watcher()
    # The closed receive() no longer waits on the queue: a message stays for whoever is next.
    receive.queue.put_nowait({"type": "http.disconnect"})
    await asyncio.sleep(0.01)
    assert receive.queue.qsize() == 1
    assert not call.disconnected


async def test_a_failing_receive_is_not_a_disconnect() -> None:
    async def broken() -> MutableMapping[str, Any]:
        raise RuntimeError("server bug")

    call = CallState(asyncio.current_task())
    call.watch(broken)
    await asyncio.sleep(0.01)
    assert not call.disconnected
    call.close_watcher()
