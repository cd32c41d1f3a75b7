"""Bounded upstream bodies (issue 19, defect 4): a non-streaming answer larger than
`limits.max_response_bytes` is a clean 502, the engine connection is dropped, the slot
released; a stream of any length is relayed unbuffered, and so is a body that is neither
JSON nor SSE (audio), which, cut short by the engine, ends short for the client too."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from gateway.testing.servers import RunningGateway, gateway
from gateway.types import ReplicaId
from gateway.upstream import Timeouts, make_client

LIMIT = 1 << 20
CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
_PIECE = b"x" * 65536


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class _HostileEngine:
    """Answers every request with `head`, then body bytes until the peer goes away."""

    def __init__(self, head: bytes, piece: Callable[[], bytes], total: int) -> None:
        self.head = head
        self.piece = piece
        self.total = total  # stop (and close) after this many body bytes
        self.sent = 0
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.lower().split(b"\r\n")
                        if line.startswith(b"content-length:")
                    ),
                    0,
                )
                request = head + await reader.readexactly(length)
                if not request.startswith(b"POST"):
                    writer.write(
                        b'HTTP/1.1 200 OK\r\ncontent-length: 38\r\n\r\n{"object":"list","data":[{"id":"m"}]}\n'
                    )
                    continue
                writer.write(self.head)
                while self.sent < self.total:
                    piece = self.piece()
                    writer.write(piece)
                    self.sent += len(piece)
                    await writer.drain()
                writer.close()
                return
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[_HostileEngine]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            yield self
        finally:
            server.close()


def _chunk() -> bytes:
    return b"%x\r\n%s\r\n" % (len(_PIECE), _PIECE)


@contextlib.asynccontextmanager
async def _in_front(engine: _HostileEngine) -> AsyncIterator[RunningGateway]:
    """The engine running, and a gateway with the response bound in front of it alone."""
    async with (
        engine.running(),
        gateway(
            [],
            replicas=[{"id": "hostile", "url": engine.url, "models": ["m"]}],
            limits={"max_response_bytes": LIMIT},
            health={"interval_s": 60},
            scrape={"enabled": False},
        ) as gw,
    ):
        yield gw


@pytest.mark.parametrize(
    ("head", "piece"),
    [
        (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 536870912\r\n\r\n",
            lambda: _PIECE,
        ),
        (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n",
            _chunk,
        ),
    ],
    ids=["huge-content-length", "endless-chunked"],
)
async def test_oversized_non_streaming_body_is_a_clean_502(
    head: bytes, piece: Callable[[], bytes]
) -> None:
    engine = _HostileEngine(head, piece, total=512 << 20)
    async with _in_front(engine) as gw:
        before = _rss()
        async with httpx.AsyncClient(base_url=gw.url, timeout=15) as http:
            resp = await http.post(CHAT, json=BODY)
        assert resp.status_code == 502, resp.status_code
        error = resp.json()["error"]
        assert error["code"] == "upstream_response_too_large"
        assert "127.0.0.1" not in error["message"]
        # The engine connection was dropped soon after the limit (socket buffers aside).
        assert engine.sent < 16 * LIMIT
        assert _rss() - before < 32 * LIMIT
        assert gw.state.cluster.in_flight[ReplicaId("hostile")] == 0


async def test_streams_are_not_bounded() -> None:
    sse = b"data: " + b"y" * 1000 + b"\n\n"
    engine = _HostileEngine(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n"
        % (len(sse) * 3000),
        lambda: sse,
        total=len(sse) * 3000,
    )
    async with _in_front(engine) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=15) as http:
            resp = await http.post(CHAT, json={**BODY, "stream": True})
        assert resp.status_code == 200, resp.text
        assert len(resp.content) == len(sse) * 3000


@pytest.mark.parametrize("kind", ["h1", "aiohttp", "httpx"])
async def test_every_client_bounds_read(kind: str) -> None:
    engine = _HostileEngine(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n",
        _chunk,
        total=64 << 20,
    )
    async with engine.running():
        client = make_client(kind, Timeouts(2, 5, 5), max_response_bytes=LIMIT)
        try:
            resp = await client.send("POST", engine.url + "/x", [], b"{}")
            with pytest.raises(Exception) as info:
                await resp.read()
            assert getattr(info.value, "code", None) == "upstream_response_too_large"
            await resp.aclose()
        finally:
            await client.aclose()


_AUDIO = b"HTTP/1.1 200 OK\r\ncontent-type: audio/wav\r\n"
SPEECH = {"model": "m", "input": "hello", "voice": "alloy"}


@contextlib.asynccontextmanager
async def _speaking(engine: _HostileEngine) -> AsyncIterator[httpx.AsyncClient]:
    async with (
        _in_front(engine) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=15) as http,
    ):
        yield http
        assert gw.state.cluster.in_flight[ReplicaId("hostile")] == 0


async def test_a_passed_through_body_is_not_bounded() -> None:
    size = 4 * LIMIT
    engine = _HostileEngine(_AUDIO + b"content-length: %d\r\n\r\n" % size, lambda: _PIECE, size)
    async with _speaking(engine) as http:
        resp = await http.post("/v1/audio/speech", json=SPEECH)
        assert resp.status_code == 200 and len(resp.content) == size


@pytest.mark.parametrize(
    ("head", "piece"),
    [
        (_AUDIO + b"content-length: %d\r\n\r\n" % (8 * LIMIT), lambda: _PIECE),
        (_AUDIO + b"transfer-encoding: chunked\r\n\r\n", _chunk),
    ],
    ids=["content-length", "chunked"],
)
async def test_a_body_cut_short_by_the_engine_ends_short_for_the_client(
    head: bytes, piece: Callable[[], bytes]
) -> None:
    # The engine goes away after 1 MB: the client must not take what it got for the whole.
    engine = _HostileEngine(head, piece, total=LIMIT)
    async with _speaking(engine) as http:
        async with http.stream("POST", "/v1/audio/speech", json=SPEECH) as resp:
            assert resp.status_code == 200
            received = 0
            with pytest.raises(httpx.RemoteProtocolError):
                async for chunk in resp.aiter_raw():
                    received += len(chunk)
        assert 0 < received <= LIMIT
