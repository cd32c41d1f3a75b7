"""The h1 client's own cases, against scripted HTTP servers on loopback (real sockets).

The behaviour every client shares (timeouts, aborts seen by the sim engine, refused
connections) is in test_upstream_clients.py; here: keep-alive reuse, stale pooled
connections, framing by close, malformed responses, flow control.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gateway.errors import UpstreamConnectError, UpstreamError, UpstreamTimeout
from gateway.upstream import Timeouts
from gateway.upstream.base import UpstreamPoolTimeout
from gateway.upstream.h1_client import H1Client

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + (await reader.readexactly(length) if length else b"")


class Scripted:
    """A loopback server running `handler` per connection; counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def _on_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            await self.handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1/x"


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[Scripted]]]:
    started: list[Scripted] = []

    async def start(handler: Handler) -> Scripted:
        s = Scripted(handler)
        s.server = await asyncio.start_server(s._on_conn, "127.0.0.1", 0)
        started.append(s)
        return s

    yield start
    for s in started:
        assert s.server is not None
        s.server.close()
        # Connections a handler still holds (waiting for a request that never comes) are
        # closed here, in this loop: left to the collector they warn once the loop is gone.
        for writer in s.writers:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


@pytest.fixture
async def client() -> AsyncIterator[H1Client]:
    c = H1Client(Timeouts(connect_s=1, response_headers_s=2, read_s=2))
    yield c
    await c.aclose()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def keep_alive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        request = await read_request(reader)
        writer.write(ok(request.split(b"\r\n", 1)[0]))
        await writer.drain()


async def test_keep_alive_reuses_one_connection(
    serve: Callable[[Handler], Awaitable[Scripted]], client: H1Client
) -> None:
    server = await serve(keep_alive)
    for i in range(5):
        resp = await client.send("POST", server.url, [(b"x-n", b"%d" % i)], b"{}")
        assert resp.status == 200 and await resp.read() == b"POST /v1/x HTTP/1.1"
        await resp.aclose()
    assert server.connections == 1


async def test_request_carries_host_length_and_headers(
    serve: Callable[[Handler], Awaitable[Scripted]], client: H1Client
) -> None:
    seen: list[bytes] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(ok(b"done"))
        await writer.drain()

    server = await serve(echo)
    resp = await client.send("POST", server.url + "?a=1", [(b"x-request-id", b"r1")], b'{"k": 1}')
    assert await resp.read() == b"done"
    await resp.aclose()
    head, body = seen[0].split(b"\r\n\r\n", 1)
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/x?a=1 HTTP/1.1"
    assert b"x-request-id: r1" in lines and b"content-length: 8" in lines
    assert any(line.startswith(b"host: 127.0.0.1:") for line in lines)
    assert body == b'{"k": 1}'


async def test_connection_the_server_closed_while_idle_is_not_reused(
    serve: Callable[[Handler], Awaitable[Scripted]], client: H1Client
) -> None:
    async def one_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(ok(b"a"))
        await writer.drain()
        # Then the server drops the idle keep-alive connection, as engines do on restart.

    server = await serve(one_then_close)
    for _ in range(3):
        resp = await client.send("POST", server.url, [], b"{}")
        assert await resp.read() == b"a"
        await resp.aclose()
        await asyncio.sleep(0.05)  # the close reaches the pooled connection
    assert server.connections == 3


async def test_connection_close_and_eof_framed_body(
    serve: Callable[[Handler], Awaitable[Scripted]], client: H1Client
) -> None:
    async def until_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-type: text/plain\r\n\r\npart1-"
        )
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(b"part2")
        await writer.drain()

    server = await serve(until_eof)
    for _ in range(2):
        resp = await client.send("POST", server.url, [], b"{}")
        assert b"".join([c async for c in resp.iter_bytes()]) == b"part1-part2"
        await resp.aclose()
    assert server.connections == 2  # `connection: close` is never pooled


async def test_malformed_response_is_an_upstream_error(
    serve: Callable[[Handler], Awaitable[Scripted]], client: H1Client
) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.5)

    server = await serve(garbage)
    with pytest.raises(UpstreamError):
        await client.send("POST", server.url, [], b"{}")


async def test_drop_mid_body_fails_the_iterator(
    serve: Callable[[Handler], Awaitable[Scripted]], client: H1Client
) -> None:
    async def short_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly-some")
        await writer.drain()

    server = await serve(short_body)
    resp = await client.send("POST", server.url, [], b"{}")
    with pytest.raises(UpstreamConnectError):
        async for _ in resp.iter_bytes():
            pass
    await resp.aclose()


async def test_slow_reader_pauses_the_engine_and_gets_every_byte(
    serve: Callable[[Handler], Awaitable[Scripted]],
) -> None:
    blob = bytes(range(256)) * 8192  # 2 MiB, far over the buffer's high-water mark
    server_done = asyncio.Event()

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(ok(blob))
        await writer.drain()
        server_done.set()

    server = await serve(big)
    client = H1Client(Timeouts(connect_s=1, response_headers_s=2, read_s=0.3))
    resp = await client.send("POST", server.url, [], b"{}")
    # Nobody reads for twice the idle-read limit: the buffer fills, reading pauses, and
    # the pause is not mistaken for a silent engine.
    await asyncio.sleep(0.6)
    conn = resp._conn
    assert conn.paused and conn.buffered < len(blob)
    received = bytearray()
    async for chunk in resp.iter_bytes():
        received += chunk
    await resp.aclose()
    await client.aclose()
    assert bytes(received) == blob and server_done.is_set()


async def test_https_goes_to_the_tls_client_and_other_schemes_fail(client: H1Client) -> None:
    # Nothing listens on port 1: the TLS client's connect error proves who handled it.
    with pytest.raises(UpstreamConnectError):
        await client.send("POST", "https://127.0.0.1:1/v1/x", [], b"{}")
    assert client._tls is not None and client._tls.name == "aiohttp"
    with pytest.raises(UpstreamError, match="cannot send"):
        await client.send("POST", "ftp://127.0.0.1:1/v1/x", [], b"{}")


async def test_pooled_connection_dropped_under_the_request_is_sent_once_more(
    serve: Callable[[Handler], Awaitable[Scripted]], client: H1Client
) -> None:
    requests_seen: list[int] = []

    async def drop_second(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first_connection = server.connections == 1
        await read_request(reader)
        requests_seen.append(server.connections)
        writer.write(ok(b"first" if first_connection else b"fresh"))
        await writer.drain()
        if first_connection:
            await read_request(reader)  # the reused connection's request: dropped unanswered
            requests_seen.append(server.connections)

    server = await serve(drop_second)
    bodies = []
    for _ in range(2):
        resp = await client.send("POST", server.url, [], b"{}")
        bodies.append(await resp.read())
        await resp.aclose()
    assert bodies == [b"first", b"fresh"] and server.connections == 2
    assert requests_seen == [1, 1, 2]


async def test_fresh_connection_dropped_without_answer_fails(
    serve: Callable[[Handler], Awaitable[Scripted]], client: H1Client
) -> None:
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    server = await serve(drop)
    with pytest.raises(UpstreamConnectError):
        await client.send("POST", server.url, [], b"{}")
    assert server.connections == 1


async def test_max_connections_caps_each_engine_and_frees_slots_on_close(
    serve: Callable[[Handler], Awaitable[Scripted]],
) -> None:
    gate = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            await gate.wait()
            writer.write(ok(b"x"))
            await writer.drain()

    server = await serve(slow)
    client = H1Client(Timeouts(connect_s=0.3, response_headers_s=5, read_s=5), max_connections=2)
    first = [asyncio.create_task(client.send("POST", server.url, [], b"{}")) for _ in range(2)]
    await asyncio.sleep(0.1)
    # A third request waits for a connection and gives up within the connect timeout, with
    # an error of its own: the engine is busy, not failing.
    with pytest.raises(UpstreamPoolTimeout, match="busy"):
        await client.send("POST", server.url, [], b"{}")
    assert server.connections == 2
    gate.set()
    for task in first:
        resp = await task
        await resp.read()
        await resp.aclose()
    # The cap counts open connections, not requests: both idle ones serve the next requests.
    for _ in range(3):
        resp = await client.send("POST", server.url, [], b"{}")
        await resp.read()
        await resp.aclose()
    assert server.connections == 2
    await client.aclose()
    await asyncio.sleep(0.05)
    assert client._open[next(iter(client._open))] == 0


async def test_idle_limit_longer_than_the_header_deadline_keeps_one_timer(
    serve: Callable[[Handler], Awaitable[Scripted]],
) -> None:
    # Headers come at once; the body then arrives after a gap longer than the headers
    # deadline (0.3 s) but shorter than the idle-read limit (0.8 s), so it must succeed;
    # a second, longer gap then times out on the idle limit, counted from the last data.
    gaps: list[float] = []

    async def gappy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nab")
        await writer.drain()
        await asyncio.sleep(0.5)
        writer.write(b"c")
        await writer.drain()
        await asyncio.sleep(5)

    server = await serve(gappy)
    client = H1Client(Timeouts(connect_s=1, response_headers_s=0.3, read_s=0.8))
    resp = await client.send("POST", server.url, [], b"{}")
    loop = asyncio.get_running_loop()
    received = bytearray()
    t_last = loop.time()
    with pytest.raises(UpstreamTimeout):
        async for chunk in resp.iter_bytes():
            gaps.append(loop.time() - t_last)
            t_last = loop.time()
            received += chunk
    idle = loop.time() - t_last
    await resp.aclose()
    await client.aclose()
    assert bytes(received) == b"abc"
    assert gaps[-1] > 0.4  # the late byte was waited for past the headers deadline
    assert 0.7 < idle < 2.0  # then the idle-read limit ended it


# -- issue 19: a response only ever goes to the request it answers ----------------------


def echo_n(request: bytes) -> bytes:
    """The body naming which request this answers (the `x-n` header it carried)."""
    for line in request.split(b"\r\n"):
        if line.startswith(b"x-n: "):
            return b"n=" + line[5:]
    return b"n=?"


async def send_n(client: H1Client, url: str, n: int) -> tuple[int, bytes]:
    resp = await client.send("POST", url, [(b"x-n", b"%d" % n)], b"{}")
    try:
        return resp.status, await resp.read()
    finally:
        await resp.aclose()


async def test_unsolicited_408_on_an_idle_connection_is_not_the_next_response(
    serve: Callable[[Handler], Awaitable[Scripted]], client: H1Client
) -> None:
    async def answer_then_408(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if server.connections == 1:
            request = await read_request(reader)
            writer.write(ok(echo_n(request)))
            await writer.drain()
            await asyncio.sleep(0.02)
            # An engine's idle timeout, sent with keep-alive: the connection stays open.
            writer.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
        while True:
            request = await read_request(reader)
            writer.write(ok(echo_n(request)))
            await writer.drain()

    server = await serve(answer_then_408)
    assert await send_n(client, server.url, 0) == (200, b"n=0")
    await asyncio.sleep(0.1)  # the 408 reaches the pooled connection
    for n in (1, 2, 3):
        assert await send_n(client, server.url, n) == (200, b"n=%d" % n)
    assert server.connections == 2  # the connection the 408 came on was dropped


@pytest.mark.parametrize(
    "interim",
    [
        b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n",
    ],
    ids=["103", "100", "100+103"],
)
@pytest.mark.parametrize("apart", [False, True], ids=["one-write", "apart"])
async def test_informational_responses_are_skipped(
    serve: Callable[[Handler], Awaitable[Scripted]], client: H1Client, interim: bytes, apart: bool
) -> None:
    async def hints_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            request = await read_request(reader)
            final = ok(echo_n(request), b"x-final: yes\r\n")
            if apart:
                writer.write(interim)
                await writer.drain()
                await asyncio.sleep(0.02)
                writer.write(final)
            else:
                writer.write(interim + final)
            await writer.drain()

    server = await serve(hints_first)
    for n in range(3):
        resp = await client.send("POST", server.url, [(b"x-n", b"%d" % n)], b"{}")
        assert resp.status == 200
        assert dict(resp.headers) == {b"content-length": b"3", b"x-final": b"yes"}
        assert await resp.read() == b"n=%d" % n
        await resp.aclose()
    assert server.connections == 1  # the exchange ended cleanly: the connection is reused


@pytest.mark.parametrize("apart", [False, True], ids=["one-write", "apart"])
async def test_a_response_pushed_after_the_answer_reaches_nobody(
    serve: Callable[[Handler], Awaitable[Scripted]], client: H1Client, apart: bool
) -> None:
    async def answer_then_push(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if server.connections == 1:
            intruder = ok(b"intruder")
            request = await read_request(reader)
            if apart:
                writer.write(ok(echo_n(request)))
                await writer.drain()
                await asyncio.sleep(0.02)
                writer.write(intruder)
            else:
                writer.write(ok(echo_n(request)) + intruder)
            await writer.drain()
        while True:
            request = await read_request(reader)
            writer.write(ok(echo_n(request)))
            await writer.drain()

    server = await serve(answer_then_push)
    resp = await client.send("POST", server.url, [(b"x-n", b"0")], b"{}")
    assert resp.status == 200 and dict(resp.headers) == {b"content-length": b"3"}
    assert await resp.read() == b"n=0"
    await resp.aclose()
    await asyncio.sleep(0.1)
    for n in (1, 2):
        assert await send_n(client, server.url, n) == (200, b"n=%d" % n)
    assert server.connections == 2


# -- issue 19: at max_connections, requests queue for the connections that are open -----


async def test_requests_past_max_connections_wait_for_a_released_connection(
    serve: Callable[[Handler], Awaitable[Scripted]],
) -> None:
    async def slowish(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            request = await read_request(reader)
            await asyncio.sleep(0.01)
            writer.write(ok(echo_n(request)))
            await writer.drain()

    server = await serve(slowish)
    # 20 requests on 2 connections take ten rounds of 10 ms: far less than the pool wait.
    client = H1Client(Timeouts(connect_s=1, response_headers_s=5, read_s=5), max_connections=2)
    results = await asyncio.gather(*(send_n(client, server.url, n) for n in range(20)))
    await client.aclose()
    assert results == [(200, b"n=%d" % n) for n in range(20)]
    assert server.connections == 2


async def test_a_connection_handed_to_a_request_cancelled_meanwhile_is_kept(
    serve: Callable[[Handler], Awaitable[Scripted]],
) -> None:
    server = await serve(keep_alive)
    client = H1Client(Timeouts(connect_s=1, response_headers_s=2, read_s=2), max_connections=1)
    first = await client.send("POST", server.url, [], b"{}")
    await first.read()
    waiting = asyncio.create_task(client.send("POST", server.url, [], b"{}"))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # at the cap
    await first.aclose()  # hands the connection to the waiting request...
    waiting.cancel()  # ...which is cancelled before it could run
    with pytest.raises(asyncio.CancelledError):
        await waiting
    for _ in range(2):
        resp = await client.send("POST", server.url, [], b"{}")
        await resp.read()
        await resp.aclose()
    await client.aclose()
    assert server.connections == 1
