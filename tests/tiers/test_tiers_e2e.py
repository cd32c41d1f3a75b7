"""`model: auto` through a real gateway in front of a small and a large simulated model,
driven with the official openai client."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai

from gateway.sim.faults import FaultConfig
from gateway.testing.servers import RunningGateway, gateway, sim_engines

HARD = "#hard"


def tiers_section(**small: Any) -> dict[str, Any]:
    return {
        "models": [
            {
                "name": "auto",
                "tiers": [
                    {
                        "name": "small",
                        "model": "small-7b",
                        "price_per_1m_tokens": 0.1,
                        "escalate": {"checks": ["length", "empty", "json"]},
                        **small,
                    },
                    {"name": "large", "model": "large-70b", "price_per_1m_tokens": 1.0},
                ],
                "rules": [
                    {"tier": "large", "tools": True},
                    {"tier": "large", "min_prompt_tokens": 2000},
                    {"tier": "large", "tenants": ["vip"]},
                ],
                "classifier": {"name": "features"},
            }
        ]
    }


@contextlib.asynccontextmanager
async def tiered_gateway(
    capture: dict[str, Any] | None = None, **small: Any
) -> AsyncIterator[RunningGateway]:
    faults = FaultConfig(hard_marker=HARD)  # the small model fails every HARD request
    async with (
        sim_engines(1, "instant", model_name="small-7b", faults=faults) as small_engines,
        sim_engines(1, "instant", model_name="large-70b") as large_engines,
    ):
        replicas = [{"id": "small-0", "url": small_engines[0].url}]
        replicas += [{"id": "large-0", "url": large_engines[0].url}]
        extra = {"trace_capture": capture} if capture is not None else {}
        async with gateway(
            small_engines + large_engines,
            replicas=replicas,
            tiers=tiers_section(**small),
            **extra,
        ) as gw:
            yield gw


def client_for(gw: RunningGateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="-", max_retries=0)


async def ask(
    client: openai.AsyncOpenAI, messages: list[dict[str, Any]], **kwargs: Any
) -> tuple[httpx.Headers, Any]:
    # No max_tokens: the simulated answer ends on its own ("stop"), unless it is HARD.
    raw = await client.chat.completions.with_raw_response.create(
        model="auto", messages=messages, **kwargs
    )
    return raw.headers, raw.parse()


async def test_easy_goes_small_rules_go_large_and_hard_escalates() -> None:
    async with tiered_gateway() as gw, client_for(gw) as client:
        headers, answer = await ask(client, [{"role": "user", "content": "hi there"}])
        assert answer.model == "small-7b"
        assert headers["x-kvgate-tier"] == "small"
        assert headers["x-kvgate-tier-reason"] == "default"
        assert headers["x-kvgate-replica"] == "small-0"

        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        headers, answer = await ask(
            client, [{"role": "user", "content": "use the tool"}], tools=[tool]
        )
        assert answer.model == "large-70b"
        assert (headers["x-kvgate-tier"], headers["x-kvgate-tier-reason"]) == ("large", "rule:0")

        long_prompt = "word " * 2000  # ~2500 tokens at 4 characters a token
        headers, answer = await ask(client, [{"role": "user", "content": long_prompt}])
        assert (headers["x-kvgate-tier"], headers["x-kvgate-tier-reason"]) == ("large", "rule:1")

        headers, answer = await ask(client, [{"role": "user", "content": f"prove it {HARD}"}])
        # the small model cut its answer (finish_reason length): the client gets the large one
        assert answer.model == "large-70b"
        assert answer.choices[0].finish_reason != "length"
        assert headers["x-kvgate-tier"] == "large"
        assert headers["x-kvgate-tier-reason"] == "escalated:length"
        assert headers["x-kvgate-replica"] == "large-0"

        headers, answer = await ask(
            client, [{"role": "user", "content": "hello"}], extra_headers={"x-kvgate-tier": "large"}
        )
        assert (headers["x-kvgate-tier"], headers["x-kvgate-tier-reason"]) == ("large", "hint")

        async with httpx.AsyncClient(base_url=gw.url) as http:
            metrics = (await http.get("/metrics")).text
        assert 'kvgate_tier_escalations_total{model="auto",reason="length",tier="small"} 1.0' in (
            metrics
        )
        # small: the easy one and the escalated attempt; large: two rules, the escalation, hint
        assert 'kvgate_tier_requests_total{model="auto",tier="small"} 2.0' in metrics
        assert 'kvgate_tier_requests_total{model="auto",tier="large"} 4.0' in metrics
        assert 'kvgate_tier_decisions_total{model="auto",reason="rule",tier="large"} 2.0' in metrics
        ledger = gw.state.tiers.ledger if gw.state.tiers is not None else None
        assert ledger is not None
        assert ledger.tokens[("auto", "small", "prompt")] > 0
        assert ledger.cost[("auto", "large")] > ledger.cost[("auto", "small")] > 0


async def test_a_conversation_stays_on_its_tier_and_stays_escalated() -> None:
    async with tiered_gateway() as gw, client_for(gw) as client:
        easy = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        headers, answer = await ask(client, easy)
        assert headers["x-kvgate-tier"] == "small"
        # the next turn is long enough for the large-prompt rule, but the conversation is
        # on the small tier (its KV cache is there)
        turn2 = [
            *easy,
            {"role": "assistant", "content": answer.choices[0].message.content},
            {"role": "user", "content": "and now " + "more " * 2000},
        ]
        headers, _ = await ask(client, turn2)
        assert (headers["x-kvgate-tier"], headers["x-kvgate-tier-reason"]) == ("small", "sticky")

        hard = [{"role": "user", "content": f"a hard one {HARD}"}]
        headers, answer = await ask(client, hard)
        assert headers["x-kvgate-tier-reason"] == "escalated:length"
        follow = [
            *hard,
            {"role": "assistant", "content": answer.choices[0].message.content},
            {"role": "user", "content": "thanks"},
        ]
        headers, answer = await ask(client, follow)
        assert (headers["x-kvgate-tier"], headers["x-kvgate-tier-reason"]) == ("large", "sticky")
        assert answer.model == "large-70b"

        # a session id names the conversation when the client sends one
        headers, _ = await ask(
            client, [{"role": "user", "content": f"x {HARD}"}], extra_headers={"X-Session-Id": "s1"}
        )
        assert headers["x-kvgate-tier"] == "large"
        headers, _ = await ask(
            client, [{"role": "user", "content": "new"}], extra_headers={"X-Session-Id": "s1"}
        )
        assert (headers["x-kvgate-tier"], headers["x-kvgate-tier-reason"]) == ("large", "sticky")


async def test_invalid_json_escalates_and_streams_pass_with_their_tier() -> None:
    async with tiered_gateway() as gw, client_for(gw) as client:
        schema = {
            "name": "answer",
            "schema": {"type": "object", "required": ["city"], "properties": {}},
        }
        headers, answer = await ask(
            client,
            [{"role": "user", "content": "where"}],
            response_format={"type": "json_schema", "json_schema": schema},
        )
        # the simulated text is never JSON: both tiers fail the check, the top one answers
        assert headers["x-kvgate-tier-reason"] == "escalated:json"
        assert answer.model == "large-70b"

        stream = await client.chat.completions.with_raw_response.create(
            model="auto",
            messages=[{"role": "user", "content": f"stream {HARD}"}],
            max_tokens=4,
            stream=True,
        )
        assert stream.headers["x-kvgate-tier"] == "small"
        chunks = [chunk async for chunk in stream.parse()]
        assert chunks and chunks[0].model == "small-7b"
        assert gw.state.tiers is not None
        assert gw.state.tiers.ledger.escalations[("auto", "small", "json")] == 1


async def test_an_unavailable_small_tier_escalates_on_error() -> None:
    async with tiered_gateway() as gw, client_for(gw) as client:
        gw.state.cluster  # noqa: B018 - the gateway is up
        async with httpx.AsyncClient() as http:
            small_url = next(r.url for r in gw.state.cluster.members.values() if r.id == "small-0")
            await http.post(small_url + "/admin/faults", json={"error": 503})
        headers, answer = await ask(client, [{"role": "user", "content": "hi"}])
        assert answer.model == "large-70b"
        assert headers["x-kvgate-tier-reason"] == "escalated:error"


def in_flight_is_zero(gw: RunningGateway) -> bool:
    return all(n == 0 for n in gw.state.cluster.view().in_flight.values())


async def test_the_capture_records_tier_decisions_never_text(tmp_path: Path) -> None:
    path = tmp_path / "capture.jsonl"
    capture = {"enabled": True, "path": str(path), "salt_file": str(tmp_path / "salt")}
    async with tiered_gateway(capture) as gw, client_for(gw) as client:
        for i in range(3):
            await ask(client, [{"role": "user", "content": f"secret easy {i}"}])
        await ask(client, [{"role": "user", "content": f"secret hard {HARD}"}])
        assert in_flight_is_zero(gw)  # the escalated attempt released its slot too
    text = path.read_text()
    assert "secret" not in text and HARD not in text
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "gateway.cli", "trace", "stats", str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    # four small attempts (one escalated away), one large answer
    assert "tier small       4 attempts (80.0%)" in done.stdout
    assert "tier large       1 attempts (20.0%)" in done.stdout
    assert "escalations      length 1" in done.stdout
    assert "tier reasons     default 4, escalated 1" in done.stdout


async def test_a_client_leaving_during_the_escalated_attempt_releases_everything() -> None:
    async with tiered_gateway() as gw:
        large_url = next(r.url for r in gw.state.cluster.members.values() if r.id == "large-0")
        async with httpx.AsyncClient() as http:
            await http.post(large_url + "/admin/faults", json={"slow": 5.0})
        quick = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="-", max_retries=0, timeout=1.0)
        async with quick:
            try:
                await ask(quick, [{"role": "user", "content": f"hard {HARD}"}])
            except openai.APITimeoutError:
                pass
            else:
                raise AssertionError("the large tier was slowed past the client's timeout")
        for _ in range(100):
            if in_flight_is_zero(gw):
                break
            await asyncio.sleep(0.05)
        assert in_flight_is_zero(gw)
        assert gw.state.tiers is not None
        ledger = gw.state.tiers.ledger
        # the small attempt answered (and escalated); the large one was cut by the client
        assert ledger.escalations[("auto", "small", "length")] == 1
        async with httpx.AsyncClient(base_url=gw.url) as http:
            metrics = (await http.get("/metrics")).text
        assert 'kvgate_client_disconnects_total{phase="before_response"} 1.0' in metrics
