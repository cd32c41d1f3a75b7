from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from gateway.cluster import Cluster
from gateway.errors import UpstreamConnectError
from gateway.health import Health, HealthMonitor
from gateway.settings import HealthSettings
from gateway.sim.faults import FaultConfig
from gateway.sim.server import SimEngine
from gateway.testing.clock import FakeClock
from gateway.testing.servers import gateway, sim_engines
from gateway.types import EngineLoad, ReplicaId, ReplicaState
from gateway.upstream import Timeouts, make_client
from tests.store.conftest import RedisServer, key_prefix, redis_server

__all__ = ["key_prefix", "redis_server"]  # fixtures of the real redis-server

R = ReplicaId("r0")


def monitor(clock: FakeClock, url: str = "http://127.0.0.1:9", **cfg: object) -> HealthMonitor:
    cluster = Cluster([ReplicaState(R, url)], clock=clock)
    settings = HealthSettings(
        **{"failure_threshold": 3, "success_threshold": 2, "cooldown_s": 5.0, **cfg}
    )  # type: ignore[arg-type]
    return HealthMonitor(cluster, make_client("aiohttp", Timeouts(0.5, 0.5, 0.5)), settings)


def test_ejection_after_threshold_and_half_open_readmission() -> None:
    clock = FakeClock()
    m = monitor(clock)
    m.record_failure(R)
    m.record_failure(R)
    m.record_success(R, probe=True)  # a probe success resets the count
    m.record_failure(R)
    m.record_failure(R)
    assert m.state(R) is Health.HEALTHY and m.cluster.is_healthy(R)
    m.record_failure(R)
    assert m.state(R) is Health.EJECTED and not m.cluster.is_healthy(R)
    m.record_success(R, probe=True)  # still cooling down
    assert m.state(R) is Health.EJECTED
    clock.advance(5.0)
    m.record_success(R, probe=True)
    assert m.state(R) is Health.HALF_OPEN and m.cluster.is_healthy(R)
    m.record_success(R)
    assert m.state(R) is Health.HEALTHY


def test_half_open_failure_re_ejects_at_once() -> None:
    clock = FakeClock()
    m = monitor(clock, failure_threshold=1)
    m.record_failure(R)
    clock.advance(6)
    m.tick()
    assert m.state(R) is Health.HALF_OPEN
    m.record_failure(R)
    assert m.state(R) is Health.EJECTED


def test_a_probe_that_passes_lifts_a_connect_ejection_at_once_but_not_a_probe_ejection() -> None:
    clock = FakeClock()
    m = monitor(clock, failure_threshold=1)
    r1 = ReplicaId("r1")
    m.cluster.set_members([ReplicaState(R, "http://127.0.0.1:9"), ReplicaState(r1, "http://x:9")])
    m.passive_failure(R, UpstreamConnectError("connecting timed out"))
    assert m.state(R) is Health.EJECTED
    m.record_success(R)  # a proxied answer is no probe
    assert m.state(R) is Health.EJECTED
    m.record_success(R, probe=True)  # well within the cooldown
    assert m.state(R) is Health.HALF_OPEN and m.cluster.is_healthy(R)
    m.record_failure(r1)  # its probe failed: out for the whole cooldown, probes or not
    m.record_success(r1, probe=True)
    assert m.state(r1) is Health.EJECTED


def test_passive_detection_can_be_disabled() -> None:
    refused = UpstreamConnectError("refused")
    m = monitor(FakeClock(), failure_threshold=1, passive=False)
    m.cluster.set_members(
        [ReplicaState(R, "http://127.0.0.1:9"), ReplicaState(ReplicaId("r1"), "http://127.0.0.1:9")]
    )
    m.passive_failure(R, refused)
    assert m.state(R) is Health.HEALTHY
    m2 = monitor(FakeClock(), failure_threshold=1)
    m2.cluster.set_members(
        [ReplicaState(R, "http://127.0.0.1:9"), ReplicaState(ReplicaId("r1"), "http://127.0.0.1:9")]
    )
    m2.passive_failure(R, refused)
    assert m2.state(R) is Health.EJECTED


async def test_probe_against_real_engine() -> None:
    async with sim_engines(1, "instant") as engines:
        clock = FakeClock()
        m = monitor(clock, engines[0].url, failure_threshold=1, cooldown_s=0)
        assert await m.probe(R)
        await engines[0].set_faults(FaultConfig(unhealthy=True))
        assert not await m.probe(R) and m.state(R) is Health.EJECTED
        await engines[0].set_faults(FaultConfig())
        assert await m.probe(R) and m.state(R) is Health.HALF_OPEN
        assert await m.probe(R) and m.state(R) is Health.HEALTHY
        await m.client.aclose()
    # Nothing listens any more: connection refused counts as a failure.
    assert not await m.probe(R)
    await m.client.aclose()


async def test_session_moves_off_a_down_replica_and_stays_moved() -> None:
    async with sim_engines(3, "instant") as engines:
        health = {
            "interval_s": 0.05,
            "timeout_s": 0.5,
            "failure_threshold": 1,
            "success_threshold": 1,
            "cooldown_s": 0.1,
        }
        async with (
            gateway(engines, health=health) as gw,
            httpx.AsyncClient(base_url=gw.url) as http,
        ):

            async def served() -> str:
                r = await http.post(
                    "/v1/chat/completions",
                    json={
                        "model": "kvgate-sim",
                        "messages": [{"role": "user", "content": "x"}],
                        "max_tokens": 1,
                    },
                    headers={"x-session-id": "sticky"},
                )
                assert r.status_code == 200
                return r.headers["x-kvgate-replica"]

            home = await served()
            engine = engines[int(home[1:])]
            await engine.set_faults(FaultConfig(unhealthy=True))
            for _ in range(100):
                if not gw.state.cluster.is_healthy(ReplicaId(home)):
                    break
                await asyncio.sleep(0.02)
            away = await served()
            assert away != home
            assert await served() == away
            text = gw.state.metrics.render().decode()
            assert f'kvgate_replica_healthy{{replica="{home}"}} 0.0' in text
            await engine.set_faults(FaultConfig())
            for _ in range(100):
                if gw.state.cluster.is_healthy(ReplicaId(home)):
                    break
                await asyncio.sleep(0.02)
            assert gw.state.cluster.is_healthy(ReplicaId(home))
            # Its cache is now where it moved: the session does not go back.
            assert await served() == away


def quiet_load(clock: FakeClock) -> EngineLoad:
    """A load as the scraper writes it for a replica with nothing running or waiting."""
    return EngineLoad(waiting=0, running=0, scraped_at=clock(), grace_s=4.75)


async def test_a_quiet_replica_is_probed_every_idle_interval_and_a_busy_one_every_interval() -> (
    None
):
    async with sim_engines(1, "instant") as engines:
        clock = FakeClock()
        m = monitor(clock, engines[0].url, interval_s=2.0, idle_interval_s=5.0)
        try:
            assert m.due(clock()) == [R]  # never probed
            assert await m.probe(R)
            # No load yet (no scraper, or not read yet): the busy rate.
            clock.advance(2.0)
            assert m.due(clock()) == [R]
            assert await m.probe(R)
            m.cluster.publish_load(R, quiet_load(clock))
            clock.advance(2.0)
            assert m.quiet(R, clock()) and m.due(clock()) == []
            clock.advance(2.4)
            # Rounds run every second (half the interval): due from half a round before.
            assert m.due(clock()) == []
            clock.advance(0.1)
            assert m.due(clock()) == [R]
            assert await m.probe(R)
            # A busy load (or a stale quiet one) is probed every interval.
            m.cluster.publish_load(R, EngineLoad(waiting=1, running=2, scraped_at=clock()))
            clock.advance(2.0)
            assert not m.quiet(R, clock()) and m.due(clock()) == [R]
            m.cluster.publish_load(R, quiet_load(clock))
            clock.advance(7.0)  # past stale_after + grace: unknown load
            assert not m.quiet(R, clock())
            # A failed probe brings the busy rate back until a probe passes.
            m.cluster.publish_load(R, quiet_load(clock))
            await engines[0].set_faults(FaultConfig(unhealthy=True))
            assert not await m.probe(R)
            assert not m.quiet(R, clock())
            clock.advance(2.0)
            assert m.due(clock()) == [R]
            await engines[0].set_faults(FaultConfig())
            assert await m.probe(R)
            m.cluster.publish_load(R, quiet_load(clock))
            assert m.quiet(R, clock())
            # A request from this gateway: busy for the idle interval after it began.
            m.cluster.acquire(R)
            assert not m.quiet(R, clock())
            m.cluster.release(R)
            clock.advance(4.9)
            m.cluster.publish_load(R, quiet_load(clock))
            assert not m.quiet(R, clock())
            clock.advance(0.1)
            assert m.quiet(R, clock())
            # One rate when the idle interval is not longer.
            one = monitor(clock, engines[0].url, interval_s=2.0, idle_interval_s=2.0)
            one.cluster.publish_load(R, quiet_load(clock))
            assert not one.quiet(R, clock())
            await one.client.aclose()
        finally:
            await m.client.aclose()


async def probes_over(engines: list[SimEngine], seconds: float) -> list[int]:
    before = [e.health_requests for e in engines]
    await asyncio.sleep(seconds)
    return [e.health_requests - b for e, b in zip(engines, before)]


async def test_a_gateway_probes_idle_engines_slowly_and_wakes_on_a_request() -> None:
    health = {"interval_s": 0.1, "idle_interval_s": 0.6, "timeout_s": 0.5}
    scrape = {"interval_s": 0.05, "idle_interval_s": 0.5, "stale_after_s": 0.5}
    async with (
        sim_engines(2, "instant") as engines,
        gateway(engines, health=health, scrape=scrape, models={"discover": False}) as gw,
        httpx.AsyncClient(base_url=gw.url) as http,
    ):
        await asyncio.sleep(1.0)  # past the first reads: both engines quiet
        idle = await probes_over(engines, 2.4)
        # 2.4 s at the busy rate would be 24 probes each; at the quiet one 4.
        assert all(2 <= n <= 7 for n in idle), idle
        before = [e.health_requests for e in engines]
        r = await http.post(
            "/v1/chat/completions",
            json={"model": "kvgate-sim", "messages": [{"role": "user", "content": "x"}]},
        )
        assert r.status_code == 200
        served = int(r.headers["x-kvgate-replica"].removeprefix("e"))
        await asyncio.sleep(0.05)
        # The request woke the probe of the engine it went to.
        assert engines[served].health_requests > before[served]
        # And it is probed at the busy rate for the idle interval after the request.
        busy = await probes_over(engines, 0.5)
        assert busy[served] >= 3, busy


@pytest.mark.redis
async def test_a_quiet_engine_whose_core_died_is_taken_out_by_every_gateway(
    redis_server: RedisServer, key_prefix: str
) -> None:
    """/health 503 while /metrics still answers, and no traffic: out within the idle
    interval plus (failure_threshold - 1) probe intervals, on both gateways of a store."""
    health = {"interval_s": 0.2, "idle_interval_s": 1.0, "timeout_s": 0.5, "failure_threshold": 3}
    scrape = {"interval_s": 0.05, "idle_interval_s": 0.5, "stale_after_s": 0.5}
    store = {"backend": "redis", "url": redis_server.url, "key_prefix": key_prefix}
    async with (
        sim_engines(3, "instant") as engines,
        gateway(engines, health=health, scrape=scrape, store=store) as a,
        gateway(engines, health=health, scrape=scrape, store=store) as b,
    ):
        # Quiet (probed every second) once the start-up reads are an idle interval old; a
        # busy host can take longer than that to get there, so wait for it, bounded.
        deadline = time.monotonic() + 6.0
        while not all(
            g.state.health.quiet(ReplicaId("e0"), g.state.cluster.clock()) for g in (a, b)
        ):
            assert time.monotonic() < deadline, "e0 never became quiet"
            await asyncio.sleep(0.05)
        await engines[0].set_faults(FaultConfig(unhealthy=True, error=500))
        died = time.monotonic()
        out: dict[int, float] = {}
        while len(out) < 2 and time.monotonic() - died < 5.0:
            for i, g in enumerate((a, b)):
                if i not in out and not g.state.cluster.is_healthy(ReplicaId("e0")):
                    out[i] = time.monotonic() - died
            await asyncio.sleep(0.01)
        # 1.0 + 2 * 0.2 s, plus a round's slack and the probes' own time on a busy host.
        assert len(out) == 2 and max(out.values()) < 2.2, out
        assert all(g.state.cluster.is_healthy(ReplicaId(f"e{i}")) for g in (a, b) for i in (1, 2))


# -- the stall canary: who is to blame for a request's timeout ---------------------------

ASK = b'{"model": "kvgate-sim", "prompt": "hello", "max_tokens": 4}'


def two_replica_monitor(url: str, **cfg: object) -> HealthMonitor:
    m = monitor(FakeClock(), url, canary_timeout_s=0.2, **cfg)
    m.cluster.set_members(
        [ReplicaState(R, url), ReplicaState(ReplicaId("r1"), "http://127.0.0.1:9")]
    )
    return m


async def test_concurrent_timeouts_share_one_canary_which_ejects_a_stalled_replica(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with sim_engines(1, "instant") as engines:
        await engines[0].set_faults(FaultConfig(stall=0))
        alone = monitor(FakeClock(), engines[0].url, canary_timeout_s=0.2)
        try:
            assert await alone.stalled(R, ASK)  # the request was innocent...
            # ...but the last replica in service is kept: nothing would be left to serve.
            assert alone.state(R) is Health.HEALTHY
            assert "last in service" in caplog.text
        finally:
            await alone.client.aclose()
        m = two_replica_monitor(engines[0].url)
        try:
            assert await asyncio.gather(m.stalled(R, ASK), m.stalled(R, ASK)) == [True, True]
            assert m.canaries_failed == 1  # one canary for both callers
            assert engines[0].faults.stalled == 2  # the lone replica's canary, then this one
            assert m.state(R) is Health.EJECTED and m.ejections[(R, "stalled")] == 1
            assert await m.stalled(R, ASK)  # already ejected: no second canary
            assert m.canaries_failed == 1
        finally:
            await m.client.aclose()


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"model": 3}', b"{}"])
async def test_a_canary_needs_a_model_to_ask_for(body: bytes) -> None:
    m = two_replica_monitor("http://127.0.0.1:9")
    try:
        assert await m.stalled(R, body) is False
        assert m.state(R) is Health.HEALTHY and m.canaries_failed == 0
    finally:
        await m.client.aclose()


async def test_a_refused_canary_or_a_canary_turned_off_blames_nobody() -> None:
    async with sim_engines(1, "instant") as engines:
        refused = two_replica_monitor("http://127.0.0.1:9")
        await engines[0].set_faults(FaultConfig(stall=0))
        off = two_replica_monitor(engines[0].url, canary=False)
        try:
            assert await refused.stalled(R, ASK) is False
            assert await off.stalled(R, ASK) is False
            assert engines[0].faults.stalled == 0  # no canary was sent
            for m in (refused, off):
                assert m.state(R) is Health.HEALTHY and m.canaries_failed == 0
        finally:
            await refused.client.aclose()
            await off.client.aclose()
