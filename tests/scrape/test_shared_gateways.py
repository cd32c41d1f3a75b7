"""Two `kvgate serve` processes sharing a real redis-server scrape each engine once.

Scrapes are counted where they land: on the simulated engines' `/metrics` (served in this
process).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.cluster import SimCluster
from tests.store.conftest import RedisServer
from tests.store.gateways import GatewayProcess, gateway_config, stop_all

pytestmark = [pytest.mark.redis, pytest.mark.slow]

ENGINES = 12
INTERVAL = 0.2
LEASE_TTL = 1.5
STALE = 2.0


@pytest.fixture
async def sim() -> AsyncIterator[SimCluster]:
    async with SimCluster(ENGINES, time_scale=20.0) as cluster:
        yield cluster


def config(sim: SimCluster, redis_url: str, prefix: str) -> dict[str, Any]:
    cfg = gateway_config(sim.urls, redis_url, prefix)
    # One rate for busy and quiet engines: the hits counted here are the sharing's alone.
    cfg["scrape"] = {
        "interval_s": INTERVAL,
        "idle_interval_s": INTERVAL,
        "lease_ttl_s": LEASE_TTL,
        "stale_after_s": STALE,
    }
    return cfg


async def series(gateway: GatewayProcess, name: str) -> dict[str, float]:
    """replica -> value of `name` on the gateway's /metrics."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(gateway.url + "/metrics", timeout=5)).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and "replica" in sample.labels:
                out[sample.labels["replica"]] = float(sample.value)
    return out


async def all_fresh(gateways: list[GatewayProcess], within: float = 15.0) -> None:
    """Until every gateway holds a fresh load of every engine."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        ages = [await series(g, "kvgate_scrape_age_seconds") for g in gateways]
        if all(len(a) == ENGINES and max(a.values()) < 1.0 for a in ages):
            return
        assert loop.time() < deadline, f"loads never all fresh: {ages}"
        await asyncio.sleep(0.2)


def hits(sim: SimCluster) -> list[int]:
    return [e.metrics_requests for e in sim.engines]


async def hits_over(sim: SimCluster, seconds: float) -> list[int]:
    before = hits(sim)
    await asyncio.sleep(seconds)
    return [b - a for a, b in zip(before, hits(sim))]


async def test_two_gateways_scrape_each_engine_once_between_them(
    sim: SimCluster, redis_server: RedisServer, key_prefix: str, tmp_path: Path
) -> None:
    cfg = config(sim, redis_server.url, key_prefix)
    gateways = [GatewayProcess(cfg, tmp_path, f"gw{i}") for i in range(2)]
    try:
        await asyncio.gather(*(g.start() for g in gateways))
        await all_fresh(gateways)
        await asyncio.sleep(LEASE_TTL)  # past the first lease rounds' rebalancing
        own = [await series(g, "kvgate_scrapes_total") for g in gateways]
        window = 3.0
        delta = await hits_over(sim, window)
        after = [await series(g, "kvgate_scrapes_total") for g in gateways]
        once = window / INTERVAL  # one gateway's scrapes of one engine
        print(f"/metrics hits per engine in {window} s (one gateway: {once:.0f}): {delta}")
        # Both gateways scraping would be 2 * once per engine.
        assert all(0.3 * once <= d <= 1.4 * once for d in delta), (delta, once)
        scraped_by = [{r for r, v in a.items() if v > b.get(r, 0.0)} for a, b in zip(after, own)]
        assert scraped_by[0] and scraped_by[1], scraped_by  # the work is split
        assert len(scraped_by[0] & scraped_by[1]) <= 1, scraped_by
        assert len(scraped_by[0] | scraped_by[1]) == ENGINES
        # And each sees every engine's load, fresh.
        for g in gateways:
            ages = await series(g, "kvgate_scrape_age_seconds")
            assert len(ages) == ENGINES and max(ages.values()) < STALE, ages
    finally:
        await stop_all(gateways)


async def test_a_killed_holders_engines_are_taken_over_within_the_lease_ttl(
    sim: SimCluster, redis_server: RedisServer, key_prefix: str, tmp_path: Path
) -> None:
    cfg = config(sim, redis_server.url, key_prefix)
    gateways = [GatewayProcess(cfg, tmp_path, f"gw{i}") for i in range(2)]
    try:
        await asyncio.gather(*(g.start() for g in gateways))
        await all_fresh(gateways)
        await asyncio.sleep(LEASE_TTL)
        victim, survivor = gateways
        before = await series(victim, "kvgate_scrapes_total")
        await asyncio.sleep(1.0)
        now = await series(victim, "kvgate_scrapes_total")
        held = {r for r, v in now.items() if v > before.get(r, 0.0)}
        assert held, "test setup: the victim held no engine"
        index = {f"e{i}": i for i in range(ENGINES)}
        assert victim.process is not None
        victim.process.kill()
        await victim.process.wait()
        loop = asyncio.get_running_loop()
        died = loop.time()
        base = hits(sim)
        taken: dict[str, float] = {}
        while len(taken) < len(held) and loop.time() - died < 10:
            await asyncio.sleep(0.05)
            now = hits(sim)
            for r in held - taken.keys():
                if now[index[r]] > base[index[r]]:
                    taken[r] = loop.time() - died
        assert taken.keys() == held, f"not taken over: {held - taken.keys()}"
        print(f"taken over after (s): { {r: round(t, 2) for r, t in sorted(taken.items())} }")
        # Its leases and member entry expire within the TTL; the next lease round (a
        # third of it) claims them. The slack is this shared host's scheduling.
        assert max(taken.values()) <= LEASE_TTL * 4 / 3 + 1.0, taken
        await asyncio.sleep(1.0)
        ages = await series(survivor, "kvgate_scrape_age_seconds")
        assert len(ages) == ENGINES and max(ages.values()) < 1.0, ages
    finally:
        await stop_all(gateways)


async def test_with_the_store_down_each_gateway_scrapes_every_engine(
    sim: SimCluster, own_redis: RedisServer, key_prefix: str, tmp_path: Path
) -> None:
    cfg = config(sim, own_redis.url, key_prefix)
    gateways = [GatewayProcess(cfg, tmp_path, f"gw{i}") for i in range(2)]
    try:
        await asyncio.gather(*(g.start() for g in gateways))
        await all_fresh(gateways)
        await asyncio.sleep(LEASE_TTL)
        shared = sum(await hits_over(sim, 2.0))
        own_redis.kill()
        await asyncio.sleep(1.0)
        own = [await series(g, "kvgate_scrapes_total") for g in gateways]
        alone = sum(await hits_over(sim, 2.0))
        after = [await series(g, "kvgate_scrapes_total") for g in gateways]
        print(f"/metrics hits in 2 s: store up {shared}, store down {alone}")
        assert alone >= 1.6 * shared, (alone, shared)
        for a, b in zip(after, own):
            assert all(a[r] > b.get(r, 0.0) for r in a) and len(a) == ENGINES, (a, b)
        by: dict[str, int] = defaultdict(int)
        for g in gateways:
            for r, age in (await series(g, "kvgate_scrape_age_seconds")).items():
                by[r] += age < 1.0
        assert all(v == 2 for v in by.values()), by
    finally:
        await stop_all(gateways)
