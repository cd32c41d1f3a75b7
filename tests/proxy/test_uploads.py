"""Multipart uploads stream through the gateway: byte for byte (checksummed at the engine),
never held whole (the engine reads the first half while the client still holds back the
second), inside the body limit, not replayed once sent, and every slot released when the
client leaves mid-upload."""

from __future__ import annotations

import asyncio
import hashlib
import os

import httpx
import openai
import pytest

from gateway.sim.faults import FaultConfig
from gateway.sim.server import SimEngine
from gateway.testing.forms import CONTENT_TYPE, form, paced
from gateway.testing.servers import RunningGateway, gateway

MODEL = "kvgate-sim"
PATH = "/v1/audio/transcriptions"
MB = 1024 * 1024
KINDS = ["h1", "httpx", "aiohttp"]  # the upstream clients: each streams the body its own way


def _idle(gw: RunningGateway) -> bool:
    return all(n == 0 for n in gw.state.cluster.in_flight.values())


async def _until(condition: object, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("kind", KINDS)
async def test_eight_mb_through_the_openai_client_arrive_byte_for_byte(
    engines: list[SimEngine], kind: str
) -> None:
    audio = os.urandom(8 * MB)
    async with (
        gateway(engines, upstream={"client": kind}) as gw,
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client,
    ):
        raw = await client.audio.transcriptions.with_raw_response.create(
            model=MODEL, file=("talk.wav", audio, "audio/wav"), language="en"
        )
        assert raw.parse().text == f"simulated transcript of {len(audio)} bytes"
        served = next(e for e in engines if e.uploads)
        assert f"e{served.index}" == raw.headers["x-kvgate-replica"]
        assert list(served.uploads) == [(hashlib.sha256(audio).hexdigest(), len(audio))]
        assert _idle(gw)


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
async def test_the_engine_reads_the_upload_before_the_client_finished_sending(
    gw: RunningGateway, engines: list[SimEngine], declared: bool
) -> None:
    """The client sends 4 MB, then waits until an engine has received them before sending
    the other 4 MB. A gateway that read the whole body before forwarding would never pass
    anything on, and the wait would time out."""
    audio = os.urandom(8 * MB)
    body = form({"model": MODEL}, audio)
    half = 4 * MB

    async def engine_has_the_first_half() -> None:
        await _until(lambda: sum(e.upload_bytes for e in engines) >= half)

    headers = {"content-type": CONTENT_TYPE}
    if declared:
        headers["content-length"] = str(len(body))
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        resp = await http.post(
            PATH, content=paced(body, half, engine_has_the_first_half), headers=headers
        )
    assert resp.status_code == 200, resp.text
    received = [u for e in engines for u in e.uploads]
    assert received == [(hashlib.sha256(audio).hexdigest(), len(audio))]
    assert _idle(gw)


@pytest.mark.parametrize("kind", KINDS)
async def test_past_the_limit_mid_upload_is_a_413_and_nothing_reaches_a_transcript(
    engines: list[SimEngine], kind: str
) -> None:
    async with gateway(engines, limits={"max_body_bytes": 2 * MB}, upstream={"client": kind}) as gw:
        body = form({"model": MODEL}, os.urandom(3 * MB))
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            # Chunked: the size is only known once the limit was crossed mid-stream.
            chunked = await http.post(
                PATH,
                content=paced(body),
                headers={"content-type": CONTENT_TYPE},
            )
            declared = await http.post(PATH, content=body, headers={"content-type": CONTENT_TYPE})
        for resp in (chunked, declared):
            assert resp.status_code == 413, resp.text
            assert resp.json()["error"]["code"] == "payload_too_large"
        assert not any(e.uploads for e in engines)
        # The engine got the first 2 MB of the chunked one, then its connection went.
        await _until(lambda: sum(e.aborted for e in engines) == 1)
        await _until(lambda: _idle(gw))


@pytest.mark.parametrize("kind", KINDS)
async def test_a_client_leaving_mid_upload_releases_everything(
    engines: list[SimEngine], kind: str
) -> None:
    async with gateway(engines, upstream={"client": kind}) as gw:
        await _leave_mid_upload(gw, engines)


async def _leave_mid_upload(gw: RunningGateway, engines: list[SimEngine]) -> None:
    body = form({"model": MODEL}, os.urandom(4 * MB))
    host, port = gw.server.host, gw.server.port
    _, writer = await asyncio.open_connection(host, port)
    head = (
        f"POST {PATH} HTTP/1.1\r\nhost: {host}\r\ncontent-type: {CONTENT_TYPE}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    writer.write(head + body[: 2 * MB])
    await writer.drain()
    await _until(lambda: sum(e.upload_bytes for e in engines) > MB)
    assert sum(gw.state.cluster.in_flight.values()) == 1  # the upload holds its slot
    writer.close()
    await _until(lambda: _idle(gw))
    await _until(lambda: sum(e.aborted for e in engines) == 1)  # the engine saw it go
    assert not any(e.uploads for e in engines)
    async with httpx.AsyncClient(base_url=gw.url) as http:
        text = (await http.get("/metrics")).text
    assert 'kvgate_client_disconnects_total{phase="before_response"} 1.0' in text


async def test_an_upload_is_retried_only_while_none_of_it_was_sent(
    engines: list[SimEngine],
) -> None:
    audio = os.urandom(MB)
    async with (
        gateway(engines) as gw,
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client,
    ):
        # Refused connections: nothing was sent, the upload goes to the replica left.
        for engine in engines[:-1]:
            await engine.set_faults(FaultConfig(refuse=True))
        text = await client.audio.transcriptions.create(model=MODEL, file=("a.wav", audio))
        assert text.text.endswith(f"{len(audio)} bytes")
        assert [len(e.uploads) for e in engines] == [0] * (len(engines) - 1) + [1]
        for engine in engines:
            await engine.set_faults(FaultConfig(error=503))
        # A 503 after the body went: not sent again, and the engine's own answer is relayed.
        before = sum(e.upload_bytes for e in engines)
        with pytest.raises(openai.InternalServerError) as info:
            await client.audio.transcriptions.create(model=MODEL, file=("a.wav", audio))
        assert info.value.status_code == 503 and "simulated fault" in info.value.message
        sent = sum(e.upload_bytes for e in engines) - before
        assert len(audio) < sent < 2 * len(audio)
        assert _idle(gw)


async def test_an_unknown_model_in_the_form_is_refused_before_anything_went_out(
    gw: RunningGateway, engines: list[SimEngine]
) -> None:
    async with httpx.AsyncClient(base_url=gw.url) as http:
        resp = await http.post(
            PATH,
            content=form({"model": "no-such-model"}, b"x"),
            headers={"content-type": CONTENT_TYPE},
        )
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    assert not any(e.upload_bytes for e in engines)  # refused before anything went out


async def test_a_streamed_transcription_is_relayed_as_a_stream(
    client: openai.AsyncOpenAI, gw: RunningGateway
) -> None:
    """`stream=true` in the form: vLLM answers `transcription.chunk` events, relayed as they
    come, and the gateway (which read the field from the form's head) counts a stream."""
    audio = os.urandom(2 * MB)
    whole = await client.audio.transcriptions.create(model=MODEL, file=("a.wav", audio))
    stream = await client.audio.transcriptions.create(
        model=MODEL, file=("a.wav", audio), stream=True
    )
    chunks = [event.model_dump() async for event in stream]
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    assert text == whole.text and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    async with httpx.AsyncClient(base_url=gw.url) as http:
        metrics = (await http.get("/metrics")).text
    streamed = 'kvgate_request_duration_seconds_count{endpoint="transcriptions",stream="true"} 1.0'
    assert streamed in metrics, [m for m in metrics.splitlines() if "transcriptions" in m]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("late", ["model", "language"])
async def test_a_field_repeated_after_the_file_is_a_400_and_never_served(
    engines: list[SimEngine], kind: str, late: str
) -> None:
    """The issue's attempt: `model` checked before the file, another after it (the engine's
    form parser keeps the last). Any field given twice is refused, as is a needed one late."""
    audio = os.urandom(MB)
    closing = b"--kvgate-test-boundary--\r\n"
    late_part = (
        f'--kvgate-test-boundary\r\nContent-Disposition: form-data; name="{late}"\r\n\r\nx\r\n'
    ).encode()
    body = form({"model": MODEL, "language": "en"}, audio)[: -len(closing)] + late_part + closing
    async with gateway(engines, upstream={"client": kind}) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            for content in (body, paced(body)):
                resp = await http.post(
                    PATH, content=content, headers={"content-type": CONTENT_TYPE}
                )
                assert resp.status_code == 400, resp.text
                assert resp.json()["error"]["param"] == late
        assert not any(e.uploads for e in engines)
        await _until(lambda: _idle(gw))
