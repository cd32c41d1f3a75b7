"""A failure after a stream began is told in-band, in the dialect of the API streaming:
a `data:` error chunk on chat (vLLM's way), the Responses API's `error` event (numbered
after the last event relayed), Anthropic's `event: error`. Each is read back through that
API's official client; the engines stall mid-stream (gateway.sim.faults) and the gateway's
read timeout fires."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anthropic
import httpx
import openai
import orjson
import pytest

from gateway.sim.faults import FaultConfig
from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway, gateway

MODEL = "kvgate-sim"


@pytest.fixture
async def gw(engines: list[SimEngine]) -> AsyncIterator[RunningGateway]:
    for engine in engines:
        await engine.set_faults(FaultConfig(stall=2))
    async with gateway(engines, timeouts={"read_s": 0.3}) as gw:
        yield gw


def _events(text: str) -> list[tuple[str | None, dict[str, object]]]:
    out: list[tuple[str | None, dict[str, object]]] = []
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines and lines["data"] != "[DONE]":
            out.append((lines.get("event"), orjson.loads(lines["data"])))
    return out


async def test_responses_stream_ends_with_a_responses_error_event(
    client: openai.AsyncOpenAI, gw: RunningGateway
) -> None:
    stream = await client.responses.create(
        model=MODEL, input="a long answer", max_output_tokens=50, stream=True
    )
    events = [event async for event in stream]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 2  # what the engine sent before it stalled went through
    last = events[-1]
    assert last.type == "error", events
    assert last.code == "upstream_timeout" and "timed out" in last.message
    assert last.sequence_number == events[-2].sequence_number + 1
    assert all(n == 0 for n in gw.state.cluster.in_flight.values())


async def test_responses_error_event_on_the_wire(gw: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
        resp = await http.post(
            "/v1/responses",
            json={"model": MODEL, "input": "x", "max_output_tokens": 50, "stream": True},
        )
    assert resp.status_code == 200
    name, data = _events(resp.text)[-1]
    assert name == "error" and data["type"] == "error" and data["code"] == "upstream_timeout"
    assert set(data) == {"type", "code", "message", "param", "sequence_number"}
    assert '"error":{' not in resp.text  # no chat-style error chunk


async def test_messages_stream_ends_with_an_anthropic_error_event(gw: RunningGateway) -> None:
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="k", max_retries=0) as client:
        pieces: list[str] = []
        with pytest.raises(anthropic.APIStatusError) as info:
            async with client.messages.stream(
                model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "x"}]
            ) as stream:
                async for text in stream.text_stream:
                    pieces.append(text)
    assert len(pieces) == 2
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "error", body
    assert body["error"]["type"] == "timeout_error" and "timed out" in body["error"]["message"]
    assert all(n == 0 for n in gw.state.cluster.in_flight.values())


async def test_chat_stream_keeps_vllms_error_chunk(
    client: openai.AsyncOpenAI, gw: RunningGateway
) -> None:
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=50, stream=True
    )
    with pytest.raises(openai.APIError) as info:
        async for _ in stream:
            pass
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "upstream_timeout"


def test_the_error_event_is_numbered_after_the_last_one_relayed() -> None:
    from gateway.errors import UpstreamTimeout, stream_error_event

    # The last event may straddle two chunks: both are searched.
    event = stream_error_event(
        UpstreamTimeout("t"), "responses", b'event: x\ndata: {"sequence_number":7}\n\nevent: y\nda'
    )
    assert b'"sequence_number":8' in event and event.startswith(b"event: error\n")
    assert b'"sequence_number":0' in stream_error_event(UpstreamTimeout("t"), "responses")
