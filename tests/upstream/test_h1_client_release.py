"""The h1 client gives back what it took on every exit path: uploads (streamed bodies) cut
short by the engine or by their own iterator, requests cancelled while waiting, responses
closed before their end, engines that never answer. Each case ends by sending through a
client capped at one connection, which only works when the slot came back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from gateway.errors import UpstreamConnectError, UpstreamTimeout
from gateway.upstream import Timeouts
from gateway.upstream.h1_client import H1Client

FAST = Timeouts(connect_s=1, response_headers_s=1, read_s=1)


class Upload:
    """A `StreamedBody` of `chunks`; `fail_after` raises once that many went out."""

    def __init__(
        self, chunks: list[bytes], *, declared: bool, fail_after: int | None = None
    ) -> None:
        self.chunks = chunks
        self.length = sum(map(len, chunks)) if declared else None
        self.fail_after = fail_after
        self.sent = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            if self.fail_after is not None and self.sent >= self.fail_after:
                raise RuntimeError("the client left mid-upload")
            self.sent += 1
            yield chunk
            await asyncio.sleep(0)


class Engine:
    """A loopback server: `mode` says how it answers; it records what it received."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.connections = 0
        self.bodies: list[bytes] = []
        self.eof_seen = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def on_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                await self.one(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            self.eof_seen.set()
        finally:
            writer.close()

    async def one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if self.mode == "silent" and b"/slow" in head:
            await reader.read()  # never answers; returns when the client drops
            raise ConnectionError
        if self.mode == "early" and b"/upload" in head:
            writer.write(b"HTTP/1.1 413 Too Large\r\ncontent-length: 2\r\n\r\nno")
            await writer.drain()
            await reader.read()  # whatever still comes, until the client drops us
            raise ConnectionError
        if b"transfer-encoding: chunked" in head.lower():
            body = b""
            while True:
                size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                data = await reader.readexactly(size + 2)
                if size == 0:
                    break
                body += data[:-2]
        else:
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            body = await reader.readexactly(length) if length else b""
        self.bodies.append(body)
        if self.mode == "stream" and b"/long" in head:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000000\r\n\r\n" + b"x" * 10)
            await writer.drain()
            await reader.read()
            raise ConnectionError
        reply = b"got %d" % len(body)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(reply), reply))
        await writer.drain()

    def url(self, path: str) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}{path}"


@pytest.fixture
async def engines() -> AsyncIterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for e in made:
        assert e.server is not None
        e.server.close()
        for w in e.writers:
            w.close()
            with contextlib.suppress(ConnectionError):
                await w.wait_closed()


async def start(engines: list[Engine], mode: str = "plain") -> Engine:
    e = Engine(mode)
    e.server = await asyncio.start_server(e.on_conn, "127.0.0.1", 0)
    engines.append(e)
    return e


async def still_serves(client: H1Client, engine: Engine) -> None:
    resp = await client.send("POST", engine.url("/ok"), [], b"ping")
    assert resp.status == 200
    assert await resp.read() == b"got 4"
    await resp.aclose()


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
async def test_a_streamed_upload_arrives_whole_in_either_framing(
    engines: list[Engine], declared: bool
) -> None:
    engine = await start(engines)
    client = H1Client(FAST, max_connections=1)
    chunks = [bytes([65 + i]) * (1000 + i) for i in range(12)]
    resp = await client.send("POST", engine.url("/upload"), [], Upload(chunks, declared=declared))
    assert await resp.read() == b"got %d" % sum(map(len, chunks))
    await resp.aclose()
    assert engine.bodies == [b"".join(chunks)]
    await still_serves(client, engine)
    await client.aclose()


async def test_a_large_upload_waits_on_the_transport_and_loses_no_byte(
    engines: list[Engine],
) -> None:
    # 8 MiB outruns the socket buffers: the writer must pause and resume, not drop or spin.
    engine = await start(engines)
    client = H1Client(FAST)
    chunks = [bytes([i % 251]) * 65536 for i in range(128)]
    resp = await client.send("POST", engine.url("/upload"), [], Upload(chunks, declared=False))
    assert await resp.read() == b"got %d" % (128 * 65536)
    await resp.aclose()
    assert engine.bodies == [b"".join(chunks)]
    await client.aclose()


async def test_an_engine_that_answers_before_the_upload_ends_gets_no_more_and_no_reuse(
    engines: list[Engine],
) -> None:
    engine = await start(engines, "early")
    client = H1Client(FAST, max_connections=1)

    class Slow(Upload):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            for chunk in self.chunks:
                self.sent += 1
                yield chunk
                await asyncio.sleep(0.02)  # the 413 arrives between chunks

    upload = Slow([b"z" * 1000] * 20, declared=True)
    resp = await client.send("POST", engine.url("/upload"), [], upload)
    assert resp.status == 413
    assert await resp.read() == b"no"
    await resp.aclose()
    assert upload.sent < 20
    # The cut-short exchange's connection is dropped: the next request opens a new one.
    await still_serves(client, engine)
    assert engine.connections == 2
    await client.aclose()


async def test_an_upload_whose_own_iterator_fails_raises_it_and_frees_the_slot(
    engines: list[Engine],
) -> None:
    engine = await start(engines)
    client = H1Client(FAST, max_connections=1)
    upload = Upload([b"a" * 100] * 5, declared=True, fail_after=2)
    with pytest.raises(RuntimeError, match="client left"):
        await client.send("POST", engine.url("/upload"), [], upload)
    await asyncio.wait_for(engine.eof_seen.wait(), 2)  # the engine saw the connection go
    await still_serves(client, engine)
    await client.aclose()


async def test_a_request_cancelled_while_waiting_for_headers_frees_its_slot(
    engines: list[Engine],
) -> None:
    engine = await start(engines, "silent")
    client = H1Client(Timeouts(connect_s=1, response_headers_s=30, read_s=30), max_connections=1)
    task = asyncio.create_task(client.send("POST", engine.url("/slow"), [], b"{}"))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(engine.eof_seen.wait(), 2)  # the engine learns the client left
    await still_serves(client, engine)
    await client.aclose()


async def test_an_engine_silent_past_the_header_deadline_times_out_and_frees_its_slot(
    engines: list[Engine],
) -> None:
    engine = await start(engines, "silent")
    client = H1Client(Timeouts(connect_s=1, response_headers_s=0.2, read_s=5), max_connections=1)
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(UpstreamTimeout):
        await client.send("POST", engine.url("/slow"), [], b"{}")
    assert 0.15 < loop.time() - began < 2
    await still_serves(client, engine)
    await client.aclose()


async def test_closing_a_response_before_its_end_drops_the_connection(
    engines: list[Engine],
) -> None:
    engine = await start(engines, "stream")
    client = H1Client(FAST, max_connections=1)
    resp = await client.send("POST", engine.url("/long"), [], b"{}")
    assert await resp.iter_bytes().__anext__() == b"x" * 10
    assert resp.body_done() is False
    await resp.aclose()
    await resp.aclose()  # idempotent
    await asyncio.wait_for(engine.eof_seen.wait(), 2)
    await still_serves(client, engine)
    assert engine.connections == 2
    await client.aclose()


async def test_read_of_a_body_cut_short_is_a_connect_error(engines: list[Engine]) -> None:
    engine = await start(engines, "stream")
    client = H1Client(FAST, max_connections=1)
    resp = await client.send("POST", engine.url("/long"), [], b"{}")
    for w in engine.writers:
        w.close()  # the engine dies 10 bytes into a 1 MB body
    with pytest.raises(UpstreamConnectError, match="dropped"):
        await resp.read()
    await resp.aclose()
    await still_serves(client, engine)
    await client.aclose()


async def test_a_refused_connection_is_a_connect_error_and_frees_its_slot(
    engines: list[Engine],
) -> None:
    engine = await start(engines)
    closed = await start(engines)
    assert closed.server is not None
    dead_url = closed.url("/x")
    closed.server.close()
    await closed.server.wait_closed()
    client = H1Client(FAST, max_connections=1)
    for _ in range(3):  # were the slot kept, the second try would wait for the pool
        with pytest.raises(UpstreamConnectError, match="cannot connect"):
            await client.send("POST", dead_url, [], b"{}")
    await still_serves(client, engine)
    await client.aclose()
