from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from sim_helpers import chat_body, eventually, test_profile

from gateway.sim.cluster import SimCluster
from gateway.sim.faults import FaultConfig, FaultState


async def test_error_fault_set_and_cleared_at_runtime() -> None:
    async with SimCluster(2, test_profile()) as cluster, httpx.AsyncClient() as c:
        url = cluster.urls[0]
        r = await c.post(f"{url}/admin/faults", json={"error": 503})
        assert r.json()["error"] == 503
        bad = await c.post(f"{url}/v1/chat/completions", json=chat_body("hi", max_tokens=2))
        other = await c.post(
            f"{cluster.urls[1]}/v1/chat/completions", json=chat_body("hi", max_tokens=2)
        )
        health = await c.get(f"{url}/health")
        await c.post(f"{url}/admin/faults", json={})
        good = await c.post(f"{url}/v1/chat/completions", json=chat_body("hi", max_tokens=2))
        invalid = await c.post(f"{url}/admin/faults", json={"eror": 1})
    assert bad.status_code == 503
    assert bad.json()["error"]["type"] == "ServiceUnavailableError"
    assert bad.json()["error"]["code"] == 503
    assert other.status_code == 200 and good.status_code == 200
    assert health.status_code == 200  # only `unhealthy` fails the health check
    assert invalid.status_code == 400


async def test_error_rate_is_partial_and_seeded() -> None:
    faults = FaultConfig(error=500, error_rate=0.5)
    async with (
        SimCluster(1, "instant", faults=faults, seed=7) as cluster,
        httpx.AsyncClient(base_url=cluster.urls[0]) as c,
    ):
        codes = [
            (await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})).status_code
            for _ in range(40)
        ]
    assert 5 < codes.count(500) < 35 and codes.count(200) == 40 - codes.count(500)


async def test_slow_fault_adds_latency() -> None:
    async with (
        SimCluster(1, "instant", faults=FaultConfig(slow=0.3)) as cluster,
        httpx.AsyncClient(base_url=cluster.urls[0]) as c,
    ):
        t0 = time.monotonic()
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        elapsed = time.monotonic() - t0
    assert r.status_code == 200 and elapsed >= 0.3


async def test_refuse_closes_the_port_and_reopens_it() -> None:
    async with SimCluster(1, test_profile()) as cluster:
        url = cluster.urls[0]
        await cluster.set_faults(0, FaultConfig(refuse=True))
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient() as c:
                await c.get(f"{url}/health")
        await cluster.set_faults(0, FaultConfig())
        async with httpx.AsyncClient() as c:
            assert (await c.get(f"{url}/health")).status_code == 200
            # Over HTTP, with an automatic re-open.
            r = await c.post(f"{url}/admin/faults", json={"refuse": True, "refuse_for": 0.3})
            assert r.status_code == 200
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient() as c:
                await c.get(f"{url}/health")
        await asyncio.sleep(0.5)
        async with httpx.AsyncClient() as c:
            assert (await c.get(f"{url}/health")).status_code == 200
        assert cluster.engines[0].faults.config.refuse is False


async def test_refuse_from_start_up_flag() -> None:
    async with (
        SimCluster(
            2, test_profile(), faults=FaultConfig(refuse=True), fault_replicas=[1]
        ) as cluster,
        httpx.AsyncClient() as c,
    ):
        assert (await c.get(cluster.urls[0] + "/health")).status_code == 200
        with pytest.raises(httpx.ConnectError):
            await c.get(cluster.urls[1] + "/health")


async def test_stall_stops_mid_stream_and_keeps_connection_open() -> None:
    async with SimCluster(1, test_profile(), faults=FaultConfig(stall=2)) as cluster:
        engine = cluster.engines[0]
        contents: list[str] = []
        async with httpx.AsyncClient(
            base_url=cluster.urls[0], timeout=httpx.Timeout(5.0, read=0.5)
        ) as c:
            body = chat_body("hello", max_tokens=50, stream=True, ignore_eos=True)
            with pytest.raises(httpx.ReadTimeout):
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if '"content":"' in line and '"content":""' not in line:
                            contents.append(line)
            assert len(contents) == 2
            assert engine.faults.stalled == 1
            # The stalled request no longer holds KV; the client leaving is noticed.
            await eventually(lambda: engine.blocks_in_use == 0 and engine.aborted == 1)
            await cluster.set_faults(0, FaultConfig())
            ok = await c.post("/v1/chat/completions", json=chat_body("hello", max_tokens=3))
    assert ok.status_code == 200


async def test_stall_non_streaming_never_answers() -> None:
    async with (
        SimCluster(1, test_profile(), faults=FaultConfig(stall=0)) as cluster,
        httpx.AsyncClient(base_url=cluster.urls[0], timeout=httpx.Timeout(5.0, read=0.3)) as c,
    ):
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/v1/chat/completions", json=chat_body("hello", max_tokens=3))


async def test_unhealthy_fault_fails_health_check() -> None:
    async with (
        SimCluster(1, test_profile(), faults=FaultConfig(unhealthy=True)) as cluster,
        httpx.AsyncClient(base_url=cluster.urls[0]) as c,
    ):
        assert (await c.get("/health")).status_code == 503
        assert (await c.get("/admin/faults")).json()["unhealthy"] is True


def test_hard_marker_fails_a_seeded_share_of_marked_prompts() -> None:
    state = FaultState(FaultConfig(hard_marker="#hard", hard_fail_rate=0.25), seed=3)
    assert not any(state.fails_hard("easy prompt") for _ in range(100))
    failed = sum(state.fails_hard("a #hard prompt") for _ in range(4000))
    assert 800 < failed < 1200
    always = FaultState(FaultConfig(hard_marker="#hard"))
    assert all(always.fails_hard("#hard") for _ in range(10))
    assert not FaultState(FaultConfig()).fails_hard("#hard")
