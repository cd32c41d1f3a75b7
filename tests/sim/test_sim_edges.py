"""Edges of the simulated engine a gateway meets in production: a stream that stalls before
its first byte, a background Response that fails, an upload whose client leaves mid-body,
and the error vocabulary (vLLM's `<Phrase>Error` types) for statuses without a phrase."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest
import pytest_asyncio
from sim_helpers import chat_body, eventually, test_profile

from gateway.sim.cluster import SimCluster
from gateway.sim.faults import NO_FAULTS, FaultConfig
from gateway.sim.wire import WireError, error_type

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster() -> AsyncIterator[SimCluster]:
    async with SimCluster(1, test_profile()) as c:
        yield c


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat_body("x", stream=True)),
        ("/v1/responses", {"input": "x", "stream": True}),
    ],
)
async def test_a_stall_at_zero_sends_headers_and_nothing_else(
    cluster: SimCluster, path: str, body: dict[str, object]
) -> None:
    engine = cluster.engines[0]
    await cluster.set_faults(0, FaultConfig(stall=0))
    stalled = engine.faults.stalled
    received = b""
    try:
        async with (
            httpx.AsyncClient(base_url=cluster.urls[0]) as http,
            http.stream("POST", path, json=body) as reply,
        ):
            assert reply.status_code == 200
            assert reply.headers["content-type"].startswith("text/event-stream")
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    async for piece in reply.aiter_raw():
                        received += piece
    finally:
        await cluster.set_faults(0, NO_FAULTS)
    assert received == b"" and engine.faults.stalled == stalled + 1
    await eventually(lambda: engine.model.num_running == 0 and engine.blocks_in_use == 0)


async def test_a_background_response_that_cannot_run_is_stored_as_failed(
    cluster: SimCluster,
) -> None:
    async with httpx.AsyncClient(base_url=cluster.urls[0]) as http:
        queued = await http.post("/v1/responses", json={"input": "x" * 8000, "background": True})
        assert queued.json()["status"] == "queued"
        rid = queued.json()["id"]
        for _ in range(100):
            stored = (await http.get(f"/v1/responses/{rid}")).json()
            if stored["status"] != "queued":
                break
            await asyncio.sleep(0.01)
    assert stored["status"] == "failed"
    assert stored["error"]["code"] == "server_error"
    assert "maximum context length" in stored["error"]["message"]
    assert cluster.engines[0].request_log[-1].status == 500


async def test_an_upload_left_mid_body_is_a_disconnect(cluster: SimCluster) -> None:
    engine = cluster.engines[0]
    gone, uploads, before = engine.aborted, len(engine.uploads), engine.upload_bytes
    host, port = cluster.urls[0].removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: sim\r\n"
        b"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 100000\r\n\r\n"
        + b"--b\r\n"
        * 100
    )
    await writer.drain()
    await eventually(lambda: engine.upload_bytes > before)  # the engine is reading it
    writer.close()
    await writer.wait_closed()
    await eventually(lambda: engine.aborted == gone + 1)
    assert len(engine.uploads) == uploads  # nothing was transcribed
    assert await reader.read() == b""


async def test_speech_needs_a_json_body(cluster: SimCluster) -> None:
    async with httpx.AsyncClient(base_url=cluster.urls[0]) as http:
        reply = await http.post("/v1/audio/speech", content=b"{not json")
    assert reply.status_code == 400
    assert reply.json()["error"]["message"].startswith("invalid JSON body")


async def test_error_types_follow_the_status_phrase_or_its_class() -> None:
    assert error_type(400) == "BadRequestError"
    assert error_type(404) == "NotFoundError"
    assert error_type(429) == "TooManyRequestsError"
    assert error_type(500) == "InternalServerError"  # the phrase already ends in "Error"
    assert error_type(503) == "ServiceUnavailableError"
    assert error_type(499) == "BadRequestError"  # no phrase: by its class
    assert error_type(599) == "ServerError"
    body = orjson.loads(WireError(429, "slow down", "field").body())
    assert body == {
        "error": {
            "message": "slow down",
            "type": "TooManyRequestsError",
            "param": "field",
            "code": 429,
        }
    }
