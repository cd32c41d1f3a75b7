from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from gateway.serving import start_server
from gateway.settings import DEFAULT_KEEP_ALIVE_S


def _app(events: list[str]) -> Starlette:
    async def hello(request: Request) -> PlainTextResponse:
        return PlainTextResponse("hi")

    async def state(request: Request) -> JSONResponse:
        return JSONResponse({"started": request.app.state.started})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        events.append("startup")
        app.state.started = True
        yield
        events.append("shutdown")

    return Starlette(routes=[Route("/", hello), Route("/state", state)], lifespan=lifespan)


async def test_free_port_lifespan_and_stop() -> None:
    events: list[str] = []
    server = await start_server(_app(events))
    assert server.port > 0
    assert server.url == f"http://127.0.0.1:{server.port}"
    assert events == ["startup"]
    async with httpx.AsyncClient(base_url=server.url) as client:
        assert (await client.get("/")).text == "hi"
        assert (await client.get("/state")).json() == {"started": True}
    await server.stop()
    assert events == ["startup", "shutdown"]
    assert server.stopped
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(base_url=server.url) as client:
            await client.get("/")


async def test_two_servers_get_distinct_ports() -> None:
    a = await start_server(_app([]))
    b = await start_server(_app([]))
    try:
        assert a.port != b.port
    finally:
        await a.stop()
        await b.stop()


async def test_pause_refuses_then_resume_on_same_port() -> None:
    server = await start_server(_app([]))
    try:
        async with httpx.AsyncClient(base_url=server.url) as client:
            assert (await client.get("/")).status_code == 200
            server.pause_listening()
            assert not server.listening
            # Let the FIN of the closed keep-alive connection reach the client's pool.
            await asyncio.sleep(0.05)
            with pytest.raises(httpx.ConnectError):
                await client.get("/")
            await server.resume_listening()
            assert server.listening
            assert (await client.get("/")).status_code == 200
    finally:
        await server.stop()


async def test_failed_startup_raises_instead_of_exiting() -> None:
    @contextlib.asynccontextmanager
    async def broken(app: Starlette) -> AsyncIterator[None]:
        raise ValueError("boom")
        yield

    with pytest.raises(RuntimeError):
        await start_server(Starlette(lifespan=broken))


async def test_idle_connections_are_kept_longer_than_clients_keep_theirs() -> None:
    server = await start_server(_app([]))
    try:
        # httpx and the openai SDK expire idle connections after 5 s: ours must outlive them.
        assert server._server.config.timeout_keep_alive == DEFAULT_KEEP_ALIVE_S > 5
    finally:
        await server.stop()


async def test_accepted_connections_have_tcp_nodelay() -> None:
    # Without TCP_NODELAY each small response waits for a delayed ACK (~40 ms on Linux).
    import socket

    server = await start_server(_app([]))
    try:
        async with httpx.AsyncClient(base_url=server.url) as client:
            assert (await client.get("/")).status_code == 200
            conns = list(server._server.server_state.connections)
            assert conns
            for conn in conns:
                sock = conn.transport.get_extra_info("socket")  # type: ignore[attr-defined]
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        await server.stop()
