"""Hostile clients on raw sockets (issue 19, defects 5 and 6): requests that never finish
are cut off, one address cannot hold every connection, trailers never become headers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx
import orjson

from gateway.testing.servers import RunningGateway, gateway, sim_engines

CHAT = b"/v1/chat/completions"
BODY = orjson.dumps(
    {"model": "kvgate-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
)
SERVER = {"header_timeout_s": 0.4, "body_timeout_s": 0.4, "max_connections_per_ip": 4}


@contextlib.asynccontextmanager
async def _gateway(**server: object) -> AsyncIterator[RunningGateway]:
    async with (
        sim_engines(1, "instant") as engines,
        gateway(engines, server={**SERVER, **server}, health={"interval_s": 60}) as gw,
    ):
        yield gw


async def _open(gw: RunningGateway) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(gw.server.host, gw.server.port)


async def _trickle_until_closed(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, piece: bytes
) -> tuple[float, bytes]:
    """Send `piece` every 50 ms until the server closes; (seconds it took, what it sent)."""
    started = time.monotonic()
    received = b""
    while time.monotonic() - started < 5:
        try:
            writer.write(piece)
            await writer.drain()
        except ConnectionError:
            break
        with contextlib.suppress(TimeoutError):
            data = await asyncio.wait_for(reader.read(65536), 0.05)
            received += data
            if not data:
                break
    writer.close()
    return time.monotonic() - started, received


async def test_slow_headers_are_cut_off() -> None:
    async with _gateway() as gw:
        reader, writer = await _open(gw)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        took, received = await _trickle_until_closed(reader, writer, b"x-a: b\r\n")
        assert took < 2 and received.startswith(b"HTTP/1.1 408")


async def test_a_silent_connection_is_cut_off() -> None:
    async with _gateway() as gw:
        reader, writer = await _open(gw)
        started = time.monotonic()
        assert (await asyncio.wait_for(reader.read(), 3)).startswith(b"HTTP/1.1 408")
        assert time.monotonic() - started < 2
        writer.close()


async def test_slow_body_is_cut_off() -> None:
    async with _gateway() as gw:
        reader, writer = await _open(gw)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n"
        )
        took, _ = await _trickle_until_closed(reader, writer, b" ")
        assert took < 2


async def test_keep_alive_then_slow_headers_are_cut_off_but_normal_clients_are_served() -> None:
    async with _gateway() as gw:
        reader, writer = await _open(gw)
        request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (len(BODY), BODY)
        )
        # Sent in pieces slower than nothing but well within the limits: served.
        for piece in (request[:20], request[20:60], request[60:]):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.05)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
        assert head.startswith(b"HTTP/1.1 200")
        length = int(
            next(
                line.split(b":")[1]
                for line in head.lower().split(b"\r\n")
                if line.startswith(b"content-length")
            )
        )
        await reader.readexactly(length)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\n")
        took, received = await _trickle_until_closed(reader, writer, b"x-a: b\r\n")
        assert took < 2 and received.startswith(b"HTTP/1.1 408")
        async with httpx.AsyncClient(base_url=gw.url) as http:
            assert (
                await http.post(
                    CHAT.decode(), content=BODY, headers={"content-type": "application/json"}
                )
            ).status_code == 200


async def test_connections_per_address_are_capped() -> None:
    async with _gateway(header_timeout_s=30) as gw:
        held = [await _open(gw) for _ in range(4)]
        reader, writer = await _open(gw)
        assert (await asyncio.wait_for(reader.read(), 2)).startswith(b"HTTP/1.1 429")
        writer.close()
        held.pop()[1].close()
        await asyncio.sleep(0.1)
        async with httpx.AsyncClient(base_url=gw.url) as http:
            resp = await http.post(
                CHAT.decode(), content=BODY, headers={"content-type": "application/json"}
            )
            assert resp.status_code == 200
        for _, w in held:
            w.close()


class _RecordingEngine:
    """Records every request's head; answers a tiny chat completion."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answer = b'{"id":"x","object":"chat.completion","choices":[]}'
        try:
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    lines = head.lower().split(b"\r\n")
                    length = next(
                        (
                            int(line.split(b":")[1])
                            for line in lines
                            if line.startswith(b"content-length:")
                        ),
                        0,
                    )
                    await reader.readexactly(length)
                    if head.startswith(b"POST"):
                        self.heads.append(head)
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                        % (len(answer), answer)
                    )
        finally:
            writer.close()  # the gateway hung up: our side closes too

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[_RecordingEngine]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            yield self
        finally:
            server.close()


async def test_chunked_trailers_are_not_request_headers() -> None:
    engine = _RecordingEngine()
    async with (
        engine.running(),
        gateway(
            [],
            replicas=[{"id": "r", "url": engine.url, "models": ["kvgate-sim"]}],
            health={"interval_s": 60},
            scrape={"enabled": False},
        ) as gw,
    ):
        reader, writer = await _open(gw)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\ntrailer: x-priority\r\n\r\n"
            b"%x\r\n%s\r\n0\r\nX-Priority: interactive\r\nX-Injected: 1\r\n\r\n" % (len(BODY), BODY)
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
        assert head.startswith(b"HTTP/1.1 200")
        writer.close()
        assert len(engine.heads) == 1
        forwarded = engine.heads[0].lower()
        assert b"x-priority" not in forwarded and b"x-injected" not in forwarded
