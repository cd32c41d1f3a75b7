"""Bodies the gateway does not read pass through as they arrive: several MB of speech from
the simulated engine reach the openai client byte for byte, the first of them while the
engine still holds its last part back (fails if the gateway holds the body whole), past a
`max_response_bytes` far smaller than the body; a client leaving mid-body stops the engine."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator

import openai
import pytest

from gateway.sim.server import SimEngine
from gateway.sim.speech import PART_BYTES, SAMPLES_PER_CHAR
from gateway.testing.servers import RunningGateway, gateway, sim_engines

MODEL = "kvgate-sim"
TEXT = "a long read " * 250  # 3000 characters: 8.6 MB of audio
SIZE = 44 + 2 * SAMPLES_PER_CHAR * len(TEXT)
LAST = (SIZE - 44) % PART_BYTES or PART_BYTES  # the engine's last part
LIMIT = 1 << 20


@pytest.fixture
async def engines() -> AsyncIterator[list[SimEngine]]:
    async with sim_engines(2, "instant") as engines:
        yield engines


@pytest.fixture
async def gw(engines: list[SimEngine]) -> AsyncIterator[RunningGateway]:
    async with gateway(engines, limits={"max_response_bytes": LIMIT}) as gw:
        yield gw


async def _wait(predicate: object, seconds: float = 5.0) -> None:
    assert callable(predicate)
    for _ in range(int(seconds / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_large_speech_is_relayed_byte_for_byte_as_it_is_made(
    client: openai.AsyncOpenAI, engines: list[SimEngine], gw: RunningGateway
) -> None:
    hold = asyncio.Event()
    for engine in engines:
        engine.speech_hold = hold
    digest, received = hashlib.sha256(), 0
    try:
        # A gateway holding the body whole would send no headers before the hold: a timeout.
        async with client.with_options(timeout=5.0).audio.speech.with_streaming_response.create(
            model=MODEL, voice="alloy", input=TEXT
        ) as response:
            assert response.headers["content-type"] == "audio/wav"
            assert int(response.headers["content-length"]) == SIZE  # the engine's, kept
            chunks = response.iter_bytes()
            # All but the engine's last part arrives while that part is still held back.
            while received < SIZE - LAST:
                chunk = await asyncio.wait_for(anext(chunks), 5.0)
                digest.update(chunk)
                received += len(chunk)
            assert sum(e.speech_bytes_sent for e in engines) == SIZE - LAST
            assert not any(e.speeches for e in engines)
            hold.set()
            async for chunk in chunks:
                digest.update(chunk)
                received += len(chunk)
    finally:
        hold.set()  # or a failed run would leave the engine waiting, and teardown with it
    assert received == SIZE
    sent = [s for e in engines for s in e.speeches]
    assert sent == [(digest.hexdigest(), SIZE)]
    assert all(n == 0 for n in gw.state.cluster.in_flight.values())


async def test_client_leaving_mid_body_stops_the_engine_and_frees_the_slot(
    client: openai.AsyncOpenAI, engines: list[SimEngine], gw: RunningGateway
) -> None:
    hold = asyncio.Event()  # never set: the engine waits with its last part
    for engine in engines:
        engine.speech_hold = hold
    try:
        async with client.with_options(timeout=5.0).audio.speech.with_streaming_response.create(
            model=MODEL, voice="alloy", input=TEXT
        ) as response:
            replica = response.headers["x-kvgate-replica"]
            received = 0
            async for chunk in response.iter_bytes():
                received += len(chunk)
                if received > 2 * LIMIT:
                    break
        engine = engines[int(replica[1:])]
        await _wait(lambda: engine.aborted == 1)
        await _wait(lambda: all(n == 0 for n in gw.state.cluster.in_flight.values()))
        assert not engine.speeches
    finally:
        hold.set()


async def test_small_speech_and_json_answers_still_work(client: openai.AsyncOpenAI) -> None:
    audio = await client.audio.speech.create(model=MODEL, voice="alloy", input="hi")
    assert audio.content.startswith(b"RIFF") and len(audio.content) == 44 + 2 * SAMPLES_PER_CHAR * 2
    # JSON is still read (and bounded): usage and ids keep working on the same gateway.
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=3
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 3
