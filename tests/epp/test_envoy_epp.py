"""Envoy (the real binary) + `kvgate epp` in front of simulated engines, through the
official `openai` client: the EPP protocol end to end on loopback."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest
from conftest import envoy, needs_envoy, rig, start_epp, stop, wait_ready

from gateway.epp.addresses import address_of
from gateway.testing.process import free_port
from gateway.testing.servers import replica_config, sim_engines

pytestmark = [needs_envoy, pytest.mark.slow]

MODEL = "kvgate-sim"


def settings(engines: Any, **extra: Any) -> dict[str, Any]:
    return {"replicas": replica_config(engines), "health": {"interval_s": 0.3}, **extra}


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key="-", max_retries=0, timeout=30)


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def settled(r: Any, name: str, value: float) -> str:
    for _ in range(100):
        text: str = await r.epp.metrics()
        if metric(text, name) >= value:
            break
        await asyncio.sleep(0.05)
    return text


async def test_conversation_sticks_without_a_header_and_usage_is_accounted(
    tmp_path: Path,
) -> None:
    async with (
        sim_engines(3) as engines,
        rig(tmp_path, settings(engines)) as r,
        client(r.base_url) as oai,
    ):
        history = [{"role": "user", "content": "tell me about the sea " * 20}]
        served: set[str] = set()
        for turn in range(4):
            raw = await oai.chat.completions.with_raw_response.create(
                model=MODEL, messages=history, max_tokens=8
            )
            answer = raw.parse()
            served.add(raw.headers["x-kvgate-replica"])
            assert answer.usage is not None and answer.usage.prompt_tokens > 0
            history += [
                {"role": "assistant", "content": answer.choices[0].message.content or ""},
                {"role": "user", "content": f"and turn {turn}?"},
            ]
        assert len(served) == 1, served  # lineage keeps the conversation on one replica
        stream = await oai.chat.completions.create(
            model=MODEL, messages=history, max_tokens=8, stream=True
        )
        chunks = [c async for c in stream]
        assert chunks and chunks[-1].usage is None  # usage asked by kvgate, stripped again
        # The EPP settles a request just after it passed the last chunk on.
        text = await settled(r, "kvgate_requests_total", 5)
        assert metric(text, "kvgate_requests_total", status="200") == 5
        assert metric(text, "kvgate_prompt_tokens_total") > 0
        assert metric(text, "kvgate_generation_tokens_total") >= 5 * 8
        assert metric(text, "kvgate_in_flight") == 0
        assert metric(text, "kvgate_epp_decision_seconds_count") == 5
        # A body of several 62,000-byte chunks reaches the engine whole: it parses it and
        # refuses the prompt's length, which it could only count from the full JSON.
        with pytest.raises(openai.BadRequestError) as too_long:
            await oai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "word " * 60_000}]
            )
        assert "maximum context length" in str(too_long.value)


async def test_a_dead_primary_fails_over_down_the_list(tmp_path: Path) -> None:
    async with (
        sim_engines(2) as engines,
        rig(tmp_path, settings(engines)) as r,
        client(r.base_url) as oai,
    ):
        messages = [{"role": "user", "content": "a long shared opening " * 30}]
        first = await oai.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=4
        )
        sticky = first.headers["x-kvgate-replica"]
        dead = next(e for e in engines if f"e{e.index}" == sticky)
        await dead.stop()  # kvgate still thinks it healthy: Envoy meets the refusal
        second = await oai.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=4
        )
        assert second.headers["x-kvgate-replica"] != sticky
        assert second.parse().choices[0].message.content
        text = await r.epp.metrics()
        assert metric(text, "kvgate_in_flight") == 0


async def test_the_subset_hint_is_honoured_and_an_empty_one_is_503(tmp_path: Path) -> None:
    async with (
        sim_engines(3) as engines,
        rig(tmp_path, settings(engines)) as r,
        client(r.base_url) as oai,
    ):
        only = engines[2]
        for i in range(4):
            raw = await oai.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"question {i}"}],
                max_tokens=2,
                extra_headers={"x-gateway-destination-endpoint-subset": address_of(only.url)},
            )
            assert raw.headers["x-kvgate-replica"] == "e2"
        with pytest.raises(openai.APIStatusError) as caught:
            await oai.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "nowhere"}],
                max_tokens=2,
                extra_headers={"x-gateway-destination-endpoint-subset": "10.255.255.1:1"},
            )
        assert caught.value.status_code == 503
        assert caught.value.response.headers["x-llm-d-request-dropped-reason"] == (
            "rejected-no-endpoints"
        )
        body = caught.value.response.json()
        assert body["error"]["code"] == "no_healthy_replica"


async def test_bad_input_and_shed_load_are_relayed_with_their_bodies(tmp_path: Path) -> None:
    admission = {
        "enabled": True,
        "saturation": {"max_inflight": 1, "max_waiting": None, "max_kv_usage": None},
        "max_wait_s": 0.3,
    }
    async with (
        sim_engines(1) as engines,
        rig(tmp_path, settings(engines, admission=admission)) as r,
        client(r.base_url) as oai,
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            await oai.chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "x"}]
            )
        assert missing.value.response.json()["error"]["code"] == "model_not_found"
        long = await oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "long"}],
            max_tokens=1000,
            stream=True,
        )
        first = await anext(aiter(long))
        assert first.choices
        with pytest.raises(openai.RateLimitError) as shed:
            await oai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "short"}], max_tokens=2
            )
        response = shed.value.response
        assert response.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
        assert response.json()["error"]["type"]
        await long.close()


async def test_a_client_that_leaves_aborts_the_engine_request(tmp_path: Path) -> None:
    async with (
        sim_engines(1) as engines,
        rig(tmp_path, settings(engines)) as r,
        client(r.base_url) as oai,
    ):
        stream = await oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "go on"}],
            max_tokens=1000,
            stream=True,
        )
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.close()
        for _ in range(100):
            text = await r.epp.metrics()
            if engines[0].aborted >= 1 and metric(text, "kvgate_in_flight") == 0:
                break
            await asyncio.sleep(0.1)
        assert engines[0].aborted >= 1
        assert metric(text, "kvgate_in_flight") == 0
        assert metric(text, "kvgate_client_disconnects_total") >= 1


async def test_envoy_keeps_serving_across_an_epp_restart(tmp_path: Path) -> None:
    """failure_mode_allow: false (FailClose): while the EPP is down a request fails fast
    (500 from Envoy); once it is back, Envoy reconnects on its own."""
    async with sim_engines(2) as engines:
        grpc_port = free_port()
        config = settings(engines)
        epp = start_epp(config, tmp_path / "kvgate.yaml", free_port(), grpc_port)
        try:
            await wait_ready(epp)
            with envoy(tmp_path, grpc_port) as (_, port):
                async with client(f"http://127.0.0.1:{port}/v1") as oai:
                    ask = {
                        "model": MODEL,
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 2,
                    }
                    assert (await oai.chat.completions.create(**ask)).choices
                    stop(epp.proc)
                    with pytest.raises(openai.InternalServerError) as down:
                        await oai.chat.completions.create(**ask)
                    assert down.value.status_code == 500
                    epp = start_epp(config, tmp_path / "kvgate.yaml", free_port(), grpc_port)
                    await wait_ready(epp)
                    assert (await oai.chat.completions.create(**ask)).choices
        finally:
            stop(epp.proc)
