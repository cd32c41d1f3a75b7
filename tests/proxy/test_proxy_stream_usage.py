"""Usage for streams the client did not ask usage for, end to end (gateway.stream_usage)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.hooks import RequestOutcome
from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway, gateway, replica_config, sim_engines

MODEL = "kvgate-sim"
MESSAGES = [{"role": "user", "content": "tell me a story about prefix caches " * 40}]


@pytest.fixture
async def engines() -> AsyncIterator[list[SimEngine]]:
    async with sim_engines(2, "instant") as engines:
        yield engines


@pytest.fixture
async def gw(engines: list[SimEngine]) -> AsyncIterator[RunningGateway]:
    async with gateway(engines) as gw:
        yield gw


def observe(gw: RunningGateway) -> list[RequestOutcome]:
    seen: list[RequestOutcome] = []
    gw.state.observers.append(seen.append)
    return seen


def events(raw: bytes) -> list[bytes]:
    return [e[len(b"data: ") :] for e in raw.split(b"\n\n") if e]


async def raw_stream(gw: RunningGateway, path: str, body: dict[str, Any]) -> bytes:
    async with httpx.AsyncClient(base_url=gw.url) as http:
        response = await http.post(path, json={"model": MODEL, "stream": True, **body})
        assert response.status_code == 200, response.text
        return response.content


async def test_stream_without_include_usage_hides_usage_but_observers_get_it(
    gw: RunningGateway,
) -> None:
    seen = observe(gw)
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client:
        for _ in range(2):  # the second turn hits the prefix cache
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=5,
                stream=True,  # type: ignore[arg-type]
            )
            chunks = [chunk async for chunk in stream]
            assert all(chunk.usage is None for chunk in chunks)
            assert all(chunk.choices for chunk in chunks)  # no usage-only chunk
            assert "".join(c.choices[0].delta.content or "" for c in chunks)
    assert [(o.ok, o.stream, o.completion_tokens) for o in seen] == [(True, True, 5)] * 2
    assert all(o.prompt_tokens and o.prompt_tokens > 300 for o in seen)
    assert seen[0].cached_tokens is not None and seen[1].cached_tokens
    assert seen[1].cached_tokens > 0


async def test_raw_stream_keeps_every_other_event_and_done(gw: RunningGateway) -> None:
    seen = observe(gw)
    raw = await raw_stream(gw, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4})
    assert raw.endswith(b"data: [DONE]\n\n")
    parsed = [orjson.loads(e) for e in events(raw)[:-1]]
    assert len(parsed) == 4 and all(p["choices"] and p["usage"] is None for p in parsed)
    assert seen[0].completion_tokens == 4 and seen[0].prompt_tokens


async def test_client_that_asked_for_usage_gets_it(gw: RunningGateway) -> None:
    seen = observe(gw)
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=3,
            stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 3
    assert seen[0].completion_tokens == 3 and seen[0].prompt_tokens == last.usage.prompt_tokens


async def test_continuous_usage_stats_is_not_stripped(gw: RunningGateway) -> None:
    seen = observe(gw)
    raw = await raw_stream(
        gw,
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "max_tokens": 3,
            "stream_options": {"continuous_usage_stats": True},
        },
    )
    parsed = [orjson.loads(e) for e in events(raw)[:-1]]
    assert parsed[-1]["choices"] == [] and parsed[-1]["usage"]["completion_tokens"] == 3
    assert seen[0].completion_tokens == 3


async def test_without_observers_the_body_is_not_touched(engines: list[SimEngine]) -> None:
    async with gateway(engines, metrics={"tokens": False}) as gw:
        assert gw.state.observers == []
        raw = await raw_stream(gw, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3})
    # The sim writes "usage" (null or not) only when include_usage reached it.
    assert b'"usage"' not in raw and raw.endswith(b"data: [DONE]\n\n")


async def test_composes_with_the_admission_payload_rewrite() -> None:
    # Admission re-serialises the body to set vLLM's `priority`; the injection must survive.
    async with sim_engines(2, "instant", priority_scheduling=True) as engines:
        replicas = replica_config(engines, priority_scheduling=True)
        async with gateway(engines, replicas=replicas, admission={"enabled": True}) as gw:
            assert gw.state.admission is not None
            seen = observe(gw)
            raw = await raw_stream(
                gw,
                "/v1/chat/completions",
                {
                    "messages": MESSAGES,
                    "max_tokens": 3,
                    "priority": "batch",
                },
            )
        records = [r for e in engines for r in e.request_log]
    assert b'"choices":[]' not in raw and b'"usage":null' in raw
    assert raw.endswith(b"data: [DONE]\n\n")
    assert [r.priority for r in records] == [2 * 3]  # class 2, rank 0 (engine_order)
    assert seen[0].ok and seen[0].completion_tokens == 3
