from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from gateway.serving import DrainingServer, _bind, start_server
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


# -- DrainingServer: `kvgate serve`'s SIGTERM drain and SIGHUP reload ----------------------
# Served from a thread of its own, as the signal handlers would call in from outside the
# loop; and off the main thread uvicorn installs no handlers and re-raises no signal at
# exit, which in this process would end the test run.


class _Drained:
    def __init__(self, delay: float, on_reload: Callable[[], Awaitable[None]] | None = None):
        self.drains: list[float] = []
        sock = _bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(_app([]), lifespan="on", log_level="warning")
        self.server = DrainingServer(
            config,
            on_drain=lambda: self.drains.append(time.monotonic()),
            drain_delay_s=delay,
            on_reload=on_reload,
        )
        self.thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve(sockets=[sock])), daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 5
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.005)

    def exited_within(self, seconds: float) -> bool:
        self.thread.join(seconds)
        return not self.thread.is_alive()


def test_sigterm_drains_at_once_and_stops_accepting_after_the_delay() -> None:
    served = _Drained(delay=0.15)
    signalled = time.monotonic()
    served.server.handle_exit(signal.SIGTERM, None)
    assert len(served.drains) == 1  # /ready turns 503 before anything else happens
    # Still listening during the delay: a load balancer's requests are still answered.
    assert httpx.get(served.url + "/").text == "hi"
    assert served.exited_within(5)
    assert time.monotonic() - signalled >= 0.15
    assert len(served.drains) == 1


def test_a_second_signal_skips_the_drain_delay() -> None:
    served = _Drained(delay=60.0)
    served.server.handle_exit(signal.SIGTERM, None)
    assert not served.exited_within(0.05)
    served.server.handle_exit(signal.SIGINT, None)
    assert served.exited_within(5)  # not 60 s
    assert len(served.drains) == 1  # drained once, however many signals


def test_no_delay_stops_at_once() -> None:
    served = _Drained(delay=0.0)
    served.server.handle_exit(signal.SIGTERM, None)
    assert served.exited_within(5)
    assert len(served.drains) == 1


def test_sighup_runs_the_reload_in_the_servers_loop() -> None:
    reloaded = threading.Event()
    loops: list[asyncio.AbstractEventLoop] = []

    async def reload() -> None:
        loops.append(asyncio.get_running_loop())
        reloaded.set()

    served = _Drained(delay=0.0, on_reload=reload)
    try:
        served.server._hang_up(signal.SIGHUP, None)
        assert reloaded.wait(5)
        assert loops == [served.server._loop]
        assert httpx.get(served.url + "/").status_code == 200  # requests undisturbed
    finally:
        served.server.handle_exit(signal.SIGTERM, None)
        assert served.exited_within(5)


# -- RunningServer's edges ----------------------------------------------------------------


async def test_stop_forces_a_stream_that_never_ends_after_its_timeout() -> None:
    async def endless(request: Request) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            while True:
                yield b"data: x\n\n"
                await asyncio.sleep(0.02)

        return StreamingResponse(chunks(), media_type="text/event-stream")

    server = await start_server(Starlette(routes=[Route("/s", endless)]))
    loop = asyncio.get_running_loop()
    async with (
        httpx.AsyncClient(base_url=server.url) as client,
        client.stream("GET", "/s") as response,
    ):
        assert response.status_code == 200
        started = loop.time()
        await server.stop(timeout=0.2)
        assert loop.time() - started < 1.5  # not uvicorn's graceful 2 s, nor forever
        assert server.stopped
        with pytest.raises(httpx.HTTPError):
            async for _ in response.aiter_bytes():
                pass
    await server.stop()  # stopping a stopped server is a no-op


async def test_a_busy_port_raises_and_leaks_no_socket() -> None:
    async with await start_server(_app([])) as running:
        with pytest.raises(OSError):
            await start_server(_app([]), port=running.port)
        await running.resume_listening()  # already listening: nothing to do
        assert running.listening


async def test_a_connection_that_missed_the_shutdown_is_closed_when_the_server_stops() -> None:
    """A connection accepted as uvicorn's shutdown began is not asked to close; it must not
    outlive the stopped server (a dead engine kept answering on a client's pooled one)."""
    server = await start_server(_app([]))
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await writer.drain()
        assert b"200" in await reader.readuntil(b"\r\n")
        [conn] = server._server.server_state.connections
        conn.shutdown = lambda: None  # type: ignore[method-assign]  # as if accepted too late
        await server.stop()
        async with asyncio.timeout(2):
            while await reader.read(65536):
                pass  # the rest of the answer, then the end of the stream
        assert reader.at_eof()
    finally:
        writer.close()
