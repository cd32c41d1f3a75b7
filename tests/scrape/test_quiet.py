"""A quiet engine is read every `idle_interval_s`; a request to it brings the busy rate back.

Reads are counted where they land, on the simulated engines' `/metrics`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import openai
import orjson
import pytest

from gateway.app import build_app
from gateway.scrape import MetricsScraper, ScrapeSettings
from gateway.scrape.config import EngineKind
from gateway.scrape.shared import decode, encode
from gateway.serving import start_server
from gateway.settings import load_settings
from gateway.sim.cluster import SimCluster
from gateway.sim.profiles import get_profile
from gateway.types import EngineLoad, ReplicaId, ReplicaState


def test_a_quiet_load_stays_fresh_for_the_longer_wait_before_its_next_read() -> None:
    assert ScrapeSettings().idle_interval_s == 10.0
    assert ScrapeSettings().quiet_grace_s == 9.75
    # One rate for every replica: no grace.
    assert ScrapeSettings(idle_interval_s=0.25).quiet_grace_s == 0.0
    assert ScrapeSettings(interval_s=1.0, idle_interval_s=0.5).quiet_grace_s == 0.0
    quiet = EngineLoad(waiting=0, running=0, scraped_at=10.0, grace_s=4.75)
    busy = EngineLoad(waiting=1, running=0, scraped_at=10.0)
    assert quiet.is_fresh(16.75, 2.0) and not quiet.is_fresh(16.76, 2.0)
    assert busy.is_fresh(12.0, 2.0) and not busy.is_fresh(12.01, 2.0)


def test_the_grace_travels_through_the_store_and_an_older_entry_reads_as_busy() -> None:
    load = EngineLoad(waiting=0, running=0, kv_usage=0.1, scraped_at=3.0, grace_s=4.75)
    shared = decode(encode(load, EngineKind.VLLM, 100.0))
    assert shared is not None and shared.load.grace_s == 4.75
    older = orjson.dumps([0.0, 0.0, 0.1, None, None, True, "vllm", 100.0])
    shared = decode(older)
    assert shared is not None and shared.load.grace_s == 0.0


async def _hits_after(engine_hits: Callable[[], int], before: int, within: float) -> float | None:
    """Seconds until the engine's /metrics count passes `before`, or None."""
    started = time.monotonic()
    while time.monotonic() - started < within:
        if engine_hits() > before:
            return time.monotonic() - started
        await asyncio.sleep(0.01)
    return None


async def test_a_request_wakes_the_reader_of_a_quiet_engine() -> None:
    settings = ScrapeSettings(interval_s=0.05, idle_interval_s=5.0, stale_after_s=10.0)
    in_flight: dict[ReplicaId, int] = {}
    async with SimCluster(1, get_profile("instant")) as sim:
        engine = sim.engines[0]
        target = ReplicaState(ReplicaId("e0"), sim.urls[0])
        scraper = MetricsScraper(settings, lambda: [target], in_flight=in_flight)
        await scraper.start()
        try:
            assert await _hits_after(lambda: engine.metrics_requests, 0, 5.0) is not None
            await asyncio.sleep(0.3)
            settled = engine.metrics_requests
            await asyncio.sleep(0.5)
            # Idle and nothing in flight: no read for the quiet interval (5 s), and the
            # load says it stays fresh until the next one.
            assert engine.metrics_requests == settled
            assert scraper.loads[target.id].grace_s == pytest.approx(4.95)
            in_flight[target.id] = 1
            scraper.wake(target.id)
            waited = await _hits_after(lambda: engine.metrics_requests, settled, 2.0)
            assert waited is not None and waited < 1.0, waited
            await asyncio.sleep(0.1)
            assert scraper.loads[target.id].grace_s == 0.0  # busy: the usual limit
            # Busy by this gateway's count: read every interval again.
            before = engine.metrics_requests
            await asyncio.sleep(0.5)
            assert engine.metrics_requests - before >= 4
        finally:
            await scraper.stop()


async def test_a_gateway_reads_idle_engines_slowly_and_a_serving_one_at_the_busy_rate() -> None:
    async with SimCluster(2, get_profile("tiny"), time_scale=1.0) as sim:
        settings = load_settings(
            replicas=[{"id": f"e{i}", "url": url} for i, url in enumerate(sim.urls)],
            models={"discover": False},
            # Staleness below the quiet interval: only the quiet grace keeps idle loads fresh.
            scrape={"interval_s": 0.05, "idle_interval_s": 0.5, "stale_after_s": 0.2},
        )
        app = build_app(settings)
        server = await start_server(app)
        try:
            cluster = app.state.gateway.cluster
            for _ in range(300):
                view = cluster.view()
                if all(view.load_of(r) is not None for r in view.replicas):
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.6)  # past the first reads: both engines quiet
            before = [e.metrics_requests for e in sim.engines]
            await asyncio.sleep(2.0)
            idle = [e.metrics_requests - b for e, b in zip(sim.engines, before)]
            # 2 s at the busy rate would be 40 reads; at the quiet one about 4.
            assert all(2 <= n <= 7 for n in idle), idle
            # Quiet, the loads stay fresh: no replica turns unknown (saturated), though
            # read less often than the staleness limit.
            for _ in range(25):
                view = cluster.view()
                assert all(view.load_of(r) is not None for r in view.replicas)
                await asyncio.sleep(0.02)

            before = [e.metrics_requests for e in sim.engines]
            async with openai.AsyncOpenAI(
                base_url=server.url + "/v1", api_key="k", max_retries=0
            ) as client:
                started = time.monotonic()
                raw = await client.chat.completions.with_raw_response.create(
                    model="kvgate-sim",
                    messages=[{"role": "user", "content": "count slowly"}],
                    max_tokens=256,
                    extra_body={"ignore_eos": True},
                )
                took = time.monotonic() - started
                served = int(raw.headers["x-kvgate-replica"].removeprefix("e"))
                usage = raw.parse().usage
                assert usage is not None and usage.completion_tokens == 256
            reads = [e.metrics_requests - b for e, b in zip(sim.engines, before)]
            # The serving engine is read at once and then every 0.05 s while its request
            # runs; the other stays at the quiet rate.
            assert took > 0.3, took  # long enough to tell the two rates apart
            assert reads[served] >= 0.5 * took / 0.05, (reads, took)
            assert reads[1 - served] <= took / 0.5 + 2, (reads, took)
        finally:
            await server.stop()


async def test_a_failed_read_ends_the_grace_of_a_quiet_load() -> None:
    settings = ScrapeSettings(interval_s=0.05, idle_interval_s=5.0)
    async with SimCluster(1, get_profile("instant")) as sim:
        target = ReplicaState(ReplicaId("e0"), sim.urls[0])
        scraper = MetricsScraper(settings, lambda: [target], in_flight={})
        await scraper.start()
        try:
            load = await scraper.scrape_once(target)
            assert load is not None and load.grace_s == pytest.approx(4.95)
            await sim.engines[0].stop()
            assert scraper.loads[target.id].grace_s  # the poll loop's reads were quiet too
            assert await scraper.scrape_once(target) is None
            # Kept, but judged by the busy limit: it turns unknown stale_after_s after it
            # was read, not 5 s later.
            kept = scraper.loads[target.id]
            assert kept.scraped_at >= load.scraped_at and kept.grace_s == 0.0
        finally:
            await scraper.stop()
