"""Concurrency slots and token charges on every exit path, on real servers: a stream the
client drops, an engine that refuses connections, a stream that completes.

The quota counters are read through what a client sees: a 429 naming the concurrent
limit while a slot is held, and the `x-ratelimit-remaining-tokens` of the next request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from gateway.auth.principal import hash_key
from gateway.sim.faults import FaultConfig
from gateway.sim.server import SimEngine
from gateway.testing.servers import gateway, replica_config, sim_engines

MODEL = "kvgate-sim"
BEARER = {"authorization": "Bearer sk-k"}


def chat(max_tokens: int = 2, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": max_tokens,
        **extra,
    }


def one_key(**limits: int) -> dict[str, Any]:
    return {"keys": [{"name": "k", "key_sha256": hash_key("sk-k"), "limits": limits}]}


@pytest.fixture
async def engines() -> AsyncIterator[list[SimEngine]]:
    async with sim_engines(1, "instant") as engines:
        yield engines


async def _served_again(http: httpx.AsyncClient) -> httpx.Response:
    """The slot is released after the response ends, a moment after the client saw it."""
    for _ in range(100):
        answer = await http.post("/v1/chat/completions", json=chat())
        if answer.status_code != 429:
            return answer
        await asyncio.sleep(0.05)
    return answer


async def test_a_held_slot_refuses_the_next_request_with_an_openai_429(
    engines: list[SimEngine],
) -> None:
    await engines[0].set_faults(FaultConfig(stall=1))  # one token, then nothing
    async with (
        gateway(engines, auth=one_key(concurrent_requests=1), models={"discover": False}) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=BEARER, timeout=10) as http,
    ):
        async with http.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as held:
            assert held.status_code == 200
            refused = await http.post("/v1/chat/completions", json=chat())
            assert refused.status_code == 429
            error = refused.json()["error"]
            assert error["type"] == "rate_limit_error"
            assert error["code"] == "rate_limit_exceeded"
            assert "key 'k': concurrent" in error["message"]
            assert refused.headers["retry-after"] == "1"
        # The client dropped the stream mid-way: its slot comes back.
        await engines[0].set_faults(FaultConfig())
        again = await _served_again(http)
        assert again.status_code == 200


async def test_the_official_client_sees_a_rate_limit_error_while_the_slot_is_held(
    engines: list[SimEngine],
) -> None:
    await engines[0].set_faults(FaultConfig(stall=1))
    async with (
        gateway(engines, auth=one_key(concurrent_requests=1), models={"discover": False}) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=BEARER, timeout=10) as http,
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-k", max_retries=0) as client,
        http.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as held,
    ):
        assert held.status_code == 200
        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        assert caught.value.status_code == 429


async def test_a_request_no_engine_took_releases_its_slot_and_is_not_charged(
    engines: list[SimEngine],
) -> None:
    limits = {"concurrent_requests": 1, "input_tokens_per_minute": 10_000}
    async with (
        gateway(
            engines,
            auth=one_key(**limits),
            models={"discover": False},
            replicas=replica_config(engines, models=[MODEL]),
        ) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=BEARER, timeout=10) as http,
    ):
        await engines[0].set_faults(FaultConfig(refuse=True))
        failed = [await http.post("/v1/chat/completions", json=chat()) for _ in range(3)]
        await engines[0].set_faults(FaultConfig())
        first = await _served_again(http)
        second = await http.post("/v1/chat/completions", json=chat())
    # Each failed request got its error, not a 429: the one before it gave its slot back.
    assert all(r.status_code >= 500 for r in failed), [r.status_code for r in failed]
    assert all("error" in r.json() for r in failed)
    assert first.status_code == second.status_code == 200
    # Nothing an engine never saw was charged; the served request was.
    assert first.headers["x-ratelimit-remaining-tokens"] == "10000"
    used = first.json()["usage"]["prompt_tokens"]
    assert used > 0
    remaining = int(second.headers["x-ratelimit-remaining-tokens"])
    assert remaining == pytest.approx(10_000 - used, abs=1)


async def test_a_streamed_request_is_charged_its_engine_usage(engines: list[SimEngine]) -> None:
    async with (
        gateway(
            engines, auth=one_key(output_tokens_per_minute=1000), models={"discover": False}
        ) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=BEARER, timeout=10) as http,
    ):
        before = await http.post("/v1/chat/completions", json=chat(max_tokens=1))
        completion = 0
        async with http.stream(
            "POST",
            "/v1/chat/completions",
            json=chat(max_tokens=12, stream=True, stream_options={"include_usage": True}),
        ) as streamed:
            async for line in streamed.aiter_lines():
                if line.startswith("data: {") and '"usage":{' in line.replace(" ", ""):
                    usage = httpx.Response(200, content=line[6:]).json()["usage"]
                    if usage:
                        completion = usage["completion_tokens"]
        after = await http.post("/v1/chat/completions", json=chat(max_tokens=1))
    assert completion > 0
    spent = int(before.headers["x-ratelimit-remaining-tokens"]) - int(
        after.headers["x-ratelimit-remaining-tokens"]
    )
    # The first request's own output (its usage) and the stream's.
    assert spent == pytest.approx(before.json()["usage"]["completion_tokens"] + completion, abs=1)
