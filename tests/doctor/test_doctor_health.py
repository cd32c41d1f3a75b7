"""`kvgate doctor` on an engine whose `/health` answers 503 while `/metrics` still answers:
vLLM's API server outlives a dead engine core, so its load looks quiet and fine. Read
directly and through a gateway that took the replica out on its probes."""

from __future__ import annotations

import asyncio

import httpx

from gateway.doctor.checks import diagnose
from gateway.doctor.cli import collect, render
from gateway.doctor.findings import Hints
from gateway.doctor.probe import parse_gateway, probe_engine
from gateway.doctor.through import check_through_gateway
from gateway.sim.faults import FaultConfig
from gateway.testing.servers import gateway, sim_engines


async def test_an_engine_answering_503_on_health_is_severe() -> None:
    async with sim_engines(2, "tiny", flavor="vllm") as engines:
        await engines[1].set_faults(FaultConfig(unhealthy=True))
        urls = [e.url for e in engines]
        async with httpx.AsyncClient(timeout=5.0) as client:
            assert (await client.get(urls[1] + "/health")).status_code == 503
            assert (await client.get(urls[1] + "/metrics")).status_code == 200
            sick = await probe_engine(client, urls[1])
            well = await probe_engine(client, urls[0])
        # /metrics was read as usual: the load is there, only the health says otherwise.
        assert sick.reading is not None and sick.error is None
        assert (sick.health_status, well.health_status) == (503, 200)
        series, _ = await collect(urls, None, samples=1, interval=0.0, timeout=5.0)
    d = diagnose(series, None, Hints(max_model_len=512))
    found = [f for f in d.findings if f.code == "engine_unhealthy"]
    assert [f.replica for f in found] == [urls[1]] and found[0].severe and d.severe
    assert f"GET {urls[1]}/health: 503" in found[0].evidence[0]
    assert "/metrics answers" in found[0].evidence[1]
    assert "restart" in found[0].suggestion
    assert "engine_unhealthy" in render(d)


async def test_a_replica_the_gateway_ejected_on_its_probes_is_a_finding() -> None:
    """The gateway exports kvgate_replica_ejected (outliers only) at 0 for a replica its
    health probes took out: kvgate_replica_healthy 0 must still be read as out of service."""
    async with sim_engines(2, "tiny") as engines:
        await engines[0].set_faults(FaultConfig(unhealthy=True))
        async with gateway(
            engines, health={"interval_s": 0.05, "failure_threshold": 1, "cooldown_s": 30}
        ) as gw:
            for _ in range(100):
                if not gw.state.cluster.is_healthy("e0"):  # type: ignore[arg-type]
                    break
                await asyncio.sleep(0.05)
            series, view = await collect(
                [e.url for e in engines], gw.url, samples=1, interval=0.0, timeout=5.0
            )
    assert view is not None and view.error is None
    assert view.healthy == {"e0": 0.0, "e1": 1.0} and view.ejected == {"e0": 0.0, "e1": 0.0}
    out = [f for f in check_through_gateway(view) if f.code == "replica_ejected"]
    assert [f.replica for f in out] == ["e0"]
    assert out[0].evidence[0] == "kvgate_replica_healthy 0"
    assert "probe 1" in out[0].evidence[1]
    d = diagnose(series, view, Hints(max_model_len=512))
    assert {(f.code, f.replica) for f in d.findings} >= {
        ("engine_unhealthy", engines[0].url),
        ("replica_ejected", "e0"),
    }


def test_outlier_and_probe_ejections_are_both_named() -> None:
    text = (
        'kvgate_replica_healthy{replica="a"} 0\n'
        'kvgate_replica_healthy{replica="b"} 0\n'
        'kvgate_replica_healthy{replica="c"} 1\n'
        'kvgate_replica_ejected{replica="a"} 1\n'
        'kvgate_replica_ejected{replica="b"} 0\n'
        'kvgate_replica_ejected{replica="c"} 0\n'
        'kvgate_replica_ejections_total{replica="a",reason="consecutive_5xx"} 1\n'
        'kvgate_replica_ejections_total{replica="b",reason="probe"} 3\n'
    )
    found = {f.replica: f for f in check_through_gateway(parse_gateway("http://gw", text, 0.0))}
    assert sorted(found) == ["a", "b"]
    assert found["a"].evidence == (
        "kvgate_replica_ejected 1",
        "ejections by reason: consecutive_5xx 1",
    )
    assert found["b"].evidence == ("kvgate_replica_healthy 0", "ejections by reason: probe 3")
