from __future__ import annotations

import asyncio

import httpx

from gateway.cluster import Cluster
from gateway.errors import UpstreamConnectError
from gateway.health import Health, HealthMonitor
from gateway.settings import HealthSettings
from gateway.sim.faults import FaultConfig
from gateway.testing.clock import FakeClock
from gateway.testing.servers import gateway, sim_engines
from gateway.types import ReplicaId, ReplicaState
from gateway.upstream import Timeouts, make_client

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
