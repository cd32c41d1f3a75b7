"""The sampler takes its history slower while the gateway is idle and nobody reads it."""

from __future__ import annotations

import asyncio
import time

import httpx

from gateway.console.runtime import ConsoleRuntime
from gateway.testing.servers import gateway, sim_engines

BODY = {"model": "kvgate-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def samples_over(rt: ConsoleRuntime, seconds: float) -> int:
    before = rt.sampler.samples_taken
    await asyncio.sleep(seconds)
    return rt.sampler.samples_taken - before


async def test_idle_and_unread_the_history_is_sampled_at_the_idle_interval() -> None:
    console = {"sample_interval_s": 0.05, "idle_sample_interval_s": 0.5, "watch_idle_s": 0.4}
    async with (
        sim_engines(1, "instant") as engines,
        gateway(engines, console=console) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        rt = gw.state.extras["console"]
        assert isinstance(rt, ConsoleRuntime)
        await asyncio.sleep(0.2)
        idle = await samples_over(rt, 1.5)
        assert 2 <= idle <= 4, idle  # 30 at sample_interval_s
        # A request: the next tick samples, and they keep coming while requests do.
        before = rt.sampler.samples_taken
        assert (await http.post("/v1/chat/completions", json=BODY)).status_code == 200
        await asyncio.sleep(0.12)
        assert rt.sampler.samples_taken > before
        # Someone reads the console: every sample_interval_s for watch_idle_s.
        assert (await http.get("/admin/fleet")).status_code == 200
        assert await samples_over(rt, 0.3) >= 4
        await asyncio.sleep(0.3)  # past watch_idle_s: idle again
        assert await samples_over(rt, 1.0) <= 3


async def test_the_history_spans_history_s_however_sparse_its_samples() -> None:
    async with (
        sim_engines(1, "instant") as engines,
        gateway(engines, console={"sample_interval_s": 1.0, "history_s": 5.0}) as gw,
    ):
        rt = gw.state.extras["console"]
        now = [time.time() + 100.0]  # after the sample taken at start-up
        rt.sampler._clock = lambda: now[0]
        for _ in range(3):  # three idle samples, 10 s apart: the oldest two are past 5 s
            rt.sampler.sample_once()
            now[0] += 10.0
        assert len(rt.sampler) == 1  # that from start-up gone too
