"""The scraper against the project's simulated engines, in both metric flavours, and wired
into a running gateway."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import build_app
from gateway.scrape import EngineKind, MetricsScraper, ScrapeSettings
from gateway.serving import start_server
from gateway.settings import load_settings
from gateway.sim.cluster import SimCluster
from gateway.sim.profiles import get_profile
from gateway.types import ReplicaId, ReplicaState


def _body(text: str, max_tokens: int) -> dict[str, object]:
    return {"model": "kvgate-sim", "prompt": text, "max_tokens": max_tokens, "ignore_eos": True}


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
async def test_reads_sim_engines_of_both_flavours(flavor: str) -> None:
    profile = get_profile("tiny")
    async with SimCluster(2, profile, flavor=flavor, time_scale=2.0) as sim:  # type: ignore[arg-type]
        targets = [ReplicaState(ReplicaId(f"e{i}"), url) for i, url in enumerate(sim.urls)]
        scraper = MetricsScraper(ScrapeSettings(), list)
        await scraper.start()
        try:
            assert dict(scraper.kinds) == {}
            idle = await scraper.scrape_once(targets[0])
            assert idle is not None
            assert dict(scraper.kinds) == {"e0": EngineKind(flavor)}  # detected from /metrics
            assert (idle.waiting, idle.running) == (0.0, 0.0)
            assert idle.kv_capacity_tokens == profile.kv_capacity_tokens
            # Keep engine 0 busy: more requests than its max_num_seqs, long outputs.
            async with httpx.AsyncClient(base_url=sim.urls[0], timeout=30) as client:
                sends = [
                    asyncio.create_task(
                        client.post("/v1/completions", json=_body(f"p{i} " * 20, 40))
                    )
                    for i in range(profile.max_num_seqs + 3)
                ]
                busy = None
                for _ in range(100):
                    await asyncio.sleep(0.01)
                    busy = await scraper.scrape_once(targets[0])
                    if busy is not None and busy.running and busy.waiting:
                        break
                assert busy is not None and busy.running > 0 and busy.waiting > 0
                assert busy.kv_usage is not None and busy.kv_usage > 0
                other = await scraper.scrape_once(targets[1])
                assert other is not None and other.running == 0
                await asyncio.gather(*sends)
                # The same prompt twice: the second one hits the prefix cache.
                for _ in range(2):
                    await client.post("/v1/completions", json=_body("again " * 60, 1))
            after = await scraper.scrape_once(targets[0])
            assert after is not None and after.prefix_hit_rate is not None
            assert after.prefix_hit_rate > 0
        finally:
            await scraper.stop()


async def test_configured_kind_mismatch_is_a_parse_failure() -> None:
    async with SimCluster(1, "instant", flavor="sglang") as sim:
        target = ReplicaState(ReplicaId("e0"), sim.urls[0])
        scraper = MetricsScraper(ScrapeSettings(engines={"e0": EngineKind.VLLM}), list)
        await scraper.start()
        try:
            assert await scraper.scrape_once(target) is None
        finally:
            await scraper.stop()


async def test_gateway_publishes_scraped_loads_and_reports_them() -> None:
    settings = load_settings(
        sim={"replicas": 2, "profile": "instant"},
        scrape={"interval_s": 0.05, "stale_after_s": 1.0},
        routing={"policy": "least_load"},
    )
    app = build_app(settings)
    server = await start_server(app)
    try:
        state = app.state.gateway
        assert state.cluster.stale_after == 1.0
        for _ in range(200):
            view = state.cluster.view()
            if all(view.load_of(r) is not None for r in view.replicas):
                break
            await asyncio.sleep(0.02)
        view = state.cluster.view()
        assert all(view.load_of(r) is not None for r in view.replicas)
        assert all(r.kv_capacity_tokens for r in view.replicas)
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="k", max_retries=0
        ) as client:
            out = await client.chat.completions.create(
                model="kvgate-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            assert out.choices[0].message.content
        async with httpx.AsyncClient() as http:
            text = (await http.get(server.url + "/metrics")).text
        seen = {
            (s.name, s.labels.get("replica"))
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }
        for replica in ("sim-0", "sim-1"):
            assert ("kvgate_scrape_waiting", replica) in seen
            assert ("kvgate_scrape_age_seconds", replica) in seen
            assert ("kvgate_scrapes_total", replica) in seen
    finally:
        await server.stop()


async def test_scraping_can_be_switched_off() -> None:
    app = build_app(
        load_settings(sim={"replicas": 1, "profile": "instant"}, scrape={"enabled": False})
    )
    assert "scrape" not in app.state.gateway.extras
