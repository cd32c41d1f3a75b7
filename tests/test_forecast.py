"""Predicted against achieved prefix-cache hits, end to end: the official openai client
through the gateway to simulated engines, which report `cached_tokens` as vLLM does. The
gateway's `kvgate_cache_*` series must add up to what the client itself was told."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway, gateway, sim_engines

MODEL = "kvgate-sim"
SYSTEM = "You review pull requests for a storage engine. " * 200  # about 2,400 tokens


@pytest.fixture
async def engines() -> AsyncIterator[list[SimEngine]]:
    async with sim_engines(3, "instant") as engines:
        yield engines


@pytest.fixture
async def gw(engines: list[SimEngine]) -> AsyncIterator[RunningGateway]:
    async with gateway(engines) as gw:
        yield gw


async def _series(gw: RunningGateway) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with httpx.AsyncClient() as http:
        text = (await http.get(gw.url + "/metrics")).text
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("kvgate_cache_"):
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "replica"))
                out[(s.name, labels)] += s.value
    return out


async def _turn(
    client: openai.AsyncOpenAI, messages: list[dict[str, str]], stream: bool
) -> tuple[str, int]:
    """(replica, cached tokens the client was told) of one turn; the turn is appended."""
    if stream:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        cached, text = 0, ""
        async for chunk in raw.parse():
            text += "".join(c.delta.content or "" for c in chunk.choices)
            if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
                cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    else:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=3,
        )
        answer = raw.parse()
        text = answer.choices[0].message.content or ""
        details = answer.usage.prompt_tokens_details if answer.usage else None
        cached = (details.cached_tokens or 0) if details is not None else 0
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "and?"}]
    return raw.headers["x-kvgate-replica"], cached


async def test_predicted_best_and_achieved_add_up_to_what_engines_reported(
    gw: RunningGateway, engines: list[SimEngine]
) -> None:
    told = 0
    homes = []
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client:
        for i, stream in enumerate((False, True)):
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"review change {i}: " + "diff line " * 300},
            ]
            for _ in range(4):
                replica, cached = await _turn(client, messages, stream)
                told += cached
            homes.append((replica, messages))
        series = await _series(gw)
        lineage = (("policy", "lineage"),)
        count = series[("kvgate_cache_prediction_error_tokens_count", lineage)]
        assert count == 8
        achieved = series[("kvgate_cache_achieved_tokens_total", lineage)]
        predicted = series[("kvgate_cache_predicted_tokens_total", lineage)]
        best = series[("kvgate_cache_best_tokens_total", lineage)]
        assert achieved == told > 0
        # Later turns were expected to hit, on the replica that held the conversation.
        assert predicted > 0 and best >= predicted

        # The engine loses its cache: the next turn is predicted to hit and does not.
        replica, messages = homes[0]
        engine = engines[int(replica[1:])]
        async with httpx.AsyncClient() as http:
            reset = await http.post(engine.url + "/reset_prefix_cache")
            assert reset.status_code == 200, reset.text
        bucket = ("kvgate_cache_prediction_error_tokens_bucket", (("le", "-256.0"), *lineage))
        misses_before = series[bucket]
        replica_after, cached = await _turn(client, messages, False)
        assert replica_after == replica and cached == 0
        after = await _series(gw)
        assert after[bucket] == misses_before + 1
