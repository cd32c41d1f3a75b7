"""A response's head leaves with its body when the app asks (gateway.coalesce), and only
then: through uvicorn with the gateway's protocol, on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from gateway.app import build_app
from gateway.asgi import Receive, Scope, Send
from gateway.scope import HEAD_HOLDER_KEY
from gateway.serving import RunningServer, start_server
from gateway.settings import load_settings
from gateway.sim.cluster import SimCluster
from gateway.sim.profiles import get_profile

HEAD = {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]}


@contextlib.asynccontextmanager
async def _serving(
    handler: object,
) -> AsyncIterator[RunningServer]:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await handler(scope, send)  # type: ignore[operator]

    server = await start_server(app)
    try:
        yield server
    finally:
        await server.stop()


async def _reads(server: RunningServer, settle: asyncio.Event | None = None) -> list[bytes]:
    """The pieces one GET's answer arrived in, each read once the server went quiet."""
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    pieces: list[bytes] = []
    while not b"".join(pieces).endswith(b"body"):
        pieces.append(await asyncio.wait_for(reader.read(65536), 5))
        if settle is not None and not settle.is_set():
            settle.set()
    writer.close()
    return pieces


async def test_held_head_goes_out_with_the_body() -> None:
    writes: list[int] = []

    async def handler(scope: Scope, send: Send) -> None:
        holder = scope[HEAD_HOLDER_KEY]
        inner = holder._transport
        # Count the socket writes: the transport is uvloop's own (no attribute to patch).
        holder._transport = _Counting(inner, writes)
        holder.hold()
        await send(HEAD)
        assert writes == []  # held
        await send({"type": "http.response.body", "body": b"body"})

    async with _serving(handler) as server:
        pieces = await _reads(server)
    assert writes == [1]
    assert b"".join(pieces).startswith(b"HTTP/1.1 200") and pieces[-1].endswith(b"\r\n\r\nbody")


async def test_an_unheld_head_is_not_delayed() -> None:
    """Without `hold()` the head goes at once, even when its body takes its time."""
    head_seen = asyncio.Event()

    async def handler(scope: Scope, send: Send) -> None:
        await send(HEAD)
        await head_seen.wait()  # released by the client's first read: the head alone
        await send({"type": "http.response.body", "body": b"body"})

    async with _serving(handler) as server:
        pieces = await _reads(server, head_seen)
    assert pieces[0].startswith(b"HTTP/1.1 200") and pieces[0].endswith(b"\r\n\r\n")
    assert pieces[-1] == b"body"


async def test_closing_sends_what_was_held() -> None:
    """An app that fails between the head and the body: the head still goes out before
    the connection closes (as it would have without holding)."""

    async def handler(scope: Scope, send: Send) -> None:
        scope[HEAD_HOLDER_KEY].hold()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("boom")

    async with _serving(handler) as server:
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200")


class _Counting:
    def __init__(self, inner: asyncio.Transport, writes: list[int]) -> None:
        self._inner = inner
        self._writes = writes

    def write(self, data: bytes) -> None:
        self._writes.append(1)
        self._inner.write(data)

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


async def test_a_head_request_gets_no_holder_and_its_answer_goes_out() -> None:
    """A HEAD answer writes no body: a held head would never leave. Through a real gateway,
    on the proxied path that holds heads (the gateway's own error on a Responses read)."""
    async with SimCluster(1, get_profile("instant")) as sim:
        settings = load_settings(
            replicas=[{"id": "e0", "url": sim.urls[0]}], models={"discover": False}
        )
        server = await start_server(build_app(settings))
        try:
            for method in (b"HEAD", b"GET"):
                reader, writer = await asyncio.open_connection(server.host, server.port)
                try:
                    writer.write(method + b" /v1/responses/resp_none HTTP/1.1\r\nhost: x\r\n\r\n")
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                finally:
                    writer.close()
                    await writer.wait_closed()
                assert head.startswith(b"HTTP/1.1 404"), (method, head)
        finally:
            await server.stop()
