"""Both upstream implementations behave the same behind the seam (real engine on loopback)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import orjson
import pytest

from gateway.errors import UpstreamConnectError, UpstreamTimeout
from gateway.sim.faults import FaultConfig
from gateway.sim.server import SimEngine
from gateway.testing.servers import sim_engines
from gateway.upstream import Timeouts, UpstreamClient, make_client

KINDS = ["h1", "aiohttp", "httpx"]
JSON = [(b"content-type", b"application/json")]


def chat(**extra: object) -> bytes:
    return orjson.dumps(
        {"model": "kvgate-sim", "messages": [{"role": "user", "content": "x"}], **extra}
    )


@pytest.fixture
async def engine() -> AsyncIterator[SimEngine]:
    async with sim_engines(1, "tiny") as engines:
        yield engines[0]


@pytest.fixture(params=KINDS)
async def client(request: pytest.FixtureRequest) -> AsyncIterator[UpstreamClient]:
    c = make_client(request.param, Timeouts(connect_s=1, response_headers_s=2, read_s=2))
    yield c
    await c.aclose()


async def test_non_streaming_roundtrip(engine: SimEngine, client: UpstreamClient) -> None:
    resp = await client.send(
        "POST",
        engine.url + "/v1/chat/completions",
        JSON + [(b"x-request-id", b"rid-1")],
        chat(max_tokens=2),
    )
    assert resp.status == 200
    names = {k.lower() for k, _ in resp.headers}
    assert b"content-type" in names
    body = orjson.loads(await resp.read())
    assert body["usage"]["completion_tokens"] == 2 and "rid-1" in body["id"]
    await resp.aclose()
    await resp.aclose()  # idempotent


async def test_streaming_chunks(engine: SimEngine, client: UpstreamClient) -> None:
    resp = await client.send(
        "POST", engine.url + "/v1/chat/completions", JSON, chat(max_tokens=5, stream=True)
    )
    chunks = [c async for c in resp.iter_bytes()]
    await resp.aclose()
    data = b"".join(chunks)
    assert data.count(b"data: ") >= 6 and data.rstrip().endswith(b"[DONE]")
    assert len(chunks) >= 2  # passed through as they came, not as one buffer


async def test_aclose_undrained_closes_connection_and_engine_aborts(client: UpstreamClient) -> None:
    async with sim_engines(1, "h200-sparse") as engines:
        engine = engines[0]
        resp = await client.send(
            "POST", engine.url + "/v1/chat/completions", JSON, chat(max_tokens=3000, stream=True)
        )
        it = resp.iter_bytes()
        await anext(it)
        await resp.aclose()
        for _ in range(200):
            if engine.aborted:
                break
            await asyncio.sleep(0.02)
        assert engine.aborted == 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_connection_refused_is_retryable_connect_error(client: UpstreamClient) -> None:
    with pytest.raises(UpstreamConnectError) as info:
        await client.send(
            "POST", f"http://127.0.0.1:{free_port()}/v1/chat/completions", JSON, chat()
        )
    assert info.value.retryable


async def test_slow_headers_time_out(engine: SimEngine, client: UpstreamClient) -> None:
    await engine.set_faults(FaultConfig(slow=3))
    with pytest.raises(UpstreamTimeout) as info:
        await client.send(
            "POST", engine.url + "/v1/chat/completions", JSON, chat(), timeouts=Timeouts(1, 0.3, 5)
        )
    assert info.value.status == 504


async def test_stalled_stream_times_out_in_iterator(
    engine: SimEngine, client: UpstreamClient
) -> None:
    await engine.set_faults(FaultConfig(stall=2))
    resp = await client.send(
        "POST",
        engine.url + "/v1/chat/completions",
        JSON,
        chat(max_tokens=50, stream=True),
        timeouts=Timeouts(1, 5, 0.3),
    )
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(UpstreamTimeout):
        async for _ in resp.iter_bytes():
            pass
    await resp.aclose()
    # The idle-read limit (0.3 s) ended it, not the 5 s response-headers deadline.
    assert asyncio.get_running_loop().time() - t0 < 3


async def test_get_requests(engine: SimEngine, client: UpstreamClient) -> None:
    resp = await client.send("GET", engine.url + "/health", ())
    await resp.read()
    await resp.aclose()
    assert resp.status == 200


def test_unknown_kind() -> None:
    with pytest.raises(ValueError):
        make_client("curl", Timeouts())


class _Streamed:
    """A `StreamedBody` counting what the client pulled from it."""

    def __init__(self, body: bytes, length: int | None, piece: int = 64 * 1024) -> None:
        self.body, self.length, self.piece, self.pulled = body, length, piece, 0

    async def _chunks(self) -> AsyncIterator[bytes]:
        for at in range(0, len(self.body), self.piece):
            chunk = self.body[at : at + self.piece]
            self.pulled += len(chunk)
            yield chunk
            await asyncio.sleep(0)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks()


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
async def test_streamed_bodies_arrive_whole(
    engine: SimEngine, client: UpstreamClient, declared: bool
) -> None:
    import hashlib
    import os

    from gateway.testing.forms import CONTENT_TYPE, form

    audio = os.urandom(3 * 1024 * 1024 + 17)
    body = form({"model": "kvgate-sim"}, audio)
    streamed = _Streamed(body, len(body) if declared else None)
    headers = [(b"content-type", CONTENT_TYPE.encode())]
    for _ in range(2):  # and the connection is good for the next request (h1 pools it)
        resp = await client.send("POST", engine.url + "/v1/audio/transcriptions", headers, streamed)
        assert resp.status == 200 and b"transcript" in await resp.read()
        await resp.aclose()
        streamed = _Streamed(body, streamed.length)
    assert list(engine.uploads) == [(hashlib.sha256(audio).hexdigest(), len(audio))] * 2


async def test_h1_stops_sending_when_the_engine_answers_early(engine: SimEngine) -> None:
    client = make_client("h1", Timeouts(connect_s=1, response_headers_s=5, read_s=5))
    try:
        # An unknown path: the engine answers 404 without reading the body.
        big = _Streamed(b"\0" * (64 * 1024 * 1024), None)
        resp = await client.send("POST", engine.url + "/nope", JSON, big)
        assert resp.status == 404
        await resp.read()
        await resp.aclose()
        assert big.pulled < len(big.body) // 2
        # The cut-short connection is not reused: the next request works.
        ok = await client.send(
            "POST", engine.url + "/v1/chat/completions", JSON, chat(max_tokens=1)
        )
        assert ok.status == 200
        await ok.aclose()
    finally:
        await client.aclose()
