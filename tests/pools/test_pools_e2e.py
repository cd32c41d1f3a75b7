"""Two simulated pools behind a real gateway, driven with the official openai client."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway, gateway, sim_engines

SERVED = "big"  # what both pools' engines serve; only the fast pool has fp4


def pools_section(**controller: Any) -> dict[str, Any]:
    return {
        "pools": [
            {
                "name": "fast",
                "price_per_card_hour": 4.0,
                "cards_per_replica": 2,
                "capabilities": ["fp4", "fp8"],
                "slots_per_replica": 8,
            },
            {
                "name": "cheap",
                "price_per_card_hour": 1.0,
                "cards_per_replica": 2,
                "capabilities": ["fp8"],
                "slots_per_replica": 8,
            },
        ],
        "models": [
            {"name": SERVED, "aliases": ["big-public"], "requires": ["fp4"]},
            {"name": "small", "aliases": ["small-public"]},
        ],
        "rules": [{"priority_class": "batch", "prefer": ["cheap"]}],
        "controller": {"interval_s": 0.05, "dwell_steps": 1, "max_step": 0.5, **controller},
    }


@contextlib.asynccontextmanager
async def two_pool_gateway(
    model: str = SERVED, **controller: Any
) -> AsyncIterator[tuple[RunningGateway, list[SimEngine], list[SimEngine]]]:
    async with (
        sim_engines(2, "tiny", model_name=model, time_scale=4.0) as fast,
        sim_engines(2, "tiny", model_name=model, time_scale=4.0) as cheap,
    ):
        replicas = [{"id": f"fast-{e.index}", "url": e.url, "pool": "fast"} for e in fast]
        replicas += [{"id": f"cheap-{e.index}", "url": e.url, "pool": "cheap"} for e in cheap]
        async with gateway(
            fast + cheap,
            replicas=replicas,
            pools=pools_section(**controller),
            health={"interval_s": 0.05, "failure_threshold": 1, "cooldown_s": 30},
        ) as gw:
            yield gw, fast, cheap


async def chat(
    client: openai.AsyncOpenAI, model: str, session: str, **headers: str
) -> tuple[str, Any]:
    raw = await client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": f"hello {session}"}],
        max_tokens=4,
        extra_headers={"X-Session-Id": session, **headers},
    )
    return raw.headers["x-kvgate-replica"], raw.parse()


async def test_alias_capability_and_cost_through_the_gateway() -> None:
    async with (
        two_pool_gateway() as (gw, fast, cheap),
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="-", max_retries=0) as client,
    ):
        replicas = Counter()
        for i in range(24):
            replica, completion = await chat(client, "big-public", f"s{i}")
            assert completion.model == SERVED and completion.choices[0].message.content
            replicas[replica] += 1
        # the cheap pool also serves "big" but lacks fp4: never used, whatever the weights
        assert set(replicas) <= {"fast-0", "fast-1"}, replicas
        stream = await client.chat.completions.create(
            model="big-public",
            messages=[{"role": "user", "content": "x" * 400}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for _ in stream:
            pass
        async with httpx.AsyncClient(base_url=gw.url) as http:
            admin = (await http.get("/admin/pools")).json()
            assert admin["models"]["big-public"] == {"served": SERVED, "pools": ["fast"]}
            fast_cost = admin["cost"]["fast"]
            assert fast_cost["requests"] == 25
            assert fast_cost["tokens"]["generated"] == 24 * 4 + 5
            assert fast_cost["tokens"]["prompt"] > 100
            assert fast_cost["cost_per_1k_tokens"]["busy"] > 0
            assert admin["cost"]["cheap"]["requests"] == 0
            metrics = (await http.get("/metrics")).text
            assert 'kvgate_pool_cost_per_1k_tokens{basis="busy",pool="fast"}' in metrics
            assert 'kvgate_pool_weight{pool="cheap"}' in metrics

        with pytest.raises(openai.NotFoundError) as missing:
            await client.chat.completions.create(
                model="nobody-serves-this", messages=[{"role": "user", "content": "x"}]
            )
        assert "nobody-serves-this" in str(missing.value)

        for engine in fast:
            await engine.stop()
        for _ in range(100):
            if not any(gw.state.cluster.is_healthy(r) for r in ("fast-0", "fast-1")):
                break
            await asyncio.sleep(0.05)
        with pytest.raises(openai.InternalServerError) as down:
            await chat(client, "big-public", "after-outage")
        assert down.value.status_code == 503
        assert "big" in down.value.message
        assert sum(len(e.request_log) for e in cheap) == 0, "no misroute to the cheap pool"


async def test_controller_moves_idle_traffic_to_the_cheap_pool_and_rules_apply() -> None:
    async with (
        two_pool_gateway("small") as (gw, _fast, _cheap),
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="-", max_retries=0) as client,
    ):
        async with httpx.AsyncClient(base_url=gw.url) as http:
            for _ in range(100):
                admin = (await http.get("/admin/pools")).json()
                if admin["weights"]["cheap"] == 1.0:
                    break
                await asyncio.sleep(0.05)
            assert admin["weights"] == {"fast": 0.0, "cheap": 1.0}
            assert admin["last_change"]["code"] == "prefer_cheaper"
            assert "below low watermark" in admin["last_change"]["reason"]
        pools = Counter()
        for i in range(12):
            replica, _ = await chat(client, "small-public", f"idle-{i}")
            pools[replica.split("-")[0]] += 1
        assert pools == {"cheap": 12}
        replica, _ = await chat(client, "small", "batch-1", **{"X-Priority-Class": "batch"})
        assert replica.startswith("cheap-")
