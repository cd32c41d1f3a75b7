"""Which failures say "the replica is sick" (issue 19, defect 3).

A request of its own that times out, a 4xx or a 5xx the engine answers for that request
alone say nothing about the replica: they must not eject it, and a timed-out request is
not re-sent to the rest of the fleet. Passive evidence never ejects the last replica.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from gateway.cluster import Cluster
from gateway.errors import UpstreamConnectError, UpstreamStatusError, UpstreamTimeout
from gateway.health import Health, HealthMonitor
from gateway.settings import HealthSettings
from gateway.sim.faults import FaultConfig
from gateway.testing.clock import FakeClock
from gateway.testing.servers import gateway, sim_engines
from gateway.types import ReplicaId, ReplicaState
from gateway.upstream import Timeouts, make_client

CHAT = "/v1/chat/completions"
A, B = ReplicaId("a"), ReplicaId("b")


def _monitor(*replicas: ReplicaId) -> HealthMonitor:
    cluster = Cluster([ReplicaState(r, "http://127.0.0.1:9") for r in replicas], clock=FakeClock())
    settings = HealthSettings(failure_threshold=1, cooldown_s=5.0)
    return HealthMonitor(cluster, make_client("h1", Timeouts(0.5, 0.5, 0.5)), settings)


def test_only_transport_failures_count_against_a_replica() -> None:
    m = _monitor(A, B)
    m.passive_failure(A, UpstreamTimeout("its own request timed out"))
    m.passive_failure(A, UpstreamStatusError("answered 503", upstream_status=503))
    m.passive_failure(A, None)  # a 5xx relayed as is
    assert m.state(A) is Health.HEALTHY
    m.passive_failure(A, UpstreamConnectError("refused"))
    assert m.state(A) is Health.EJECTED


def test_passive_evidence_never_ejects_the_last_replica() -> None:
    m = _monitor(A, B)
    m.passive_failure(A, UpstreamConnectError("refused"))
    m.passive_failure(B, UpstreamConnectError("refused"))
    assert m.state(A) is Health.EJECTED and m.state(B) is Health.HEALTHY
    m.record_failure(B)  # an active probe still can
    assert m.state(B) is Health.EJECTED


async def test_over_long_requests_eject_nobody_and_others_see_no_503() -> None:
    async with (
        sim_engines(3, "tiny") as engines,
        gateway(
            engines,
            timeouts={"response_headers_s": 0.3},
            health={"failure_threshold": 1, "interval_s": 60},
            models={"discover": False},
        ) as gw,
    ):
        state = gw.state
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            long = {
                "model": "kvgate-sim",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 900,
            }
            bad = await asyncio.gather(*(http.post(CHAT, json=long) for _ in range(4)))
            assert all(r.status_code == 504 for r in bad), [r.status_code for r in bad]
            assert all(state.cluster.is_healthy(ReplicaId(f"e{i}")) for i in range(3))
            # Not re-sent onto the fleet: one engine per timed-out request (each also
            # got a one-token canary, which it answered, so none is held to have stalled).
            chats = [r for e in engines for r in e.request_log if r.endpoint == "chat"]
            assert len(chats) == 4
            assert state.health.canaries_failed == 0
            short = {**long, "max_tokens": 2}
            good = [await http.post(CHAT, json=short) for _ in range(6)]
            assert [r.status_code for r in good] == [200] * 6


async def test_a_replica_answering_500_for_one_request_is_not_ejected() -> None:
    async with (
        sim_engines(2, "instant", faults=FaultConfig(error=500)) as engines,
        gateway(
            engines, health={"failure_threshold": 1, "interval_s": 60}, models={"discover": False}
        ) as gw,
    ):
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            body = {
                "model": "kvgate-sim",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 2,
            }
            for _ in range(3):
                assert (await http.post(CHAT, json=body)).status_code == 500
        assert all(gw.state.cluster.is_healthy(ReplicaId(f"e{i}")) for i in range(2))


def test_an_ejection_is_a_warning_with_its_evidence(caplog: pytest.LogCaptureFixture) -> None:
    m = _monitor(A, B)
    with caplog.at_level(logging.INFO, logger="kvgate.health"):
        m.passive_failure(A, UpstreamConnectError("cannot connect: Connection refused"))
    (record,) = [r for r in caplog.records if "ejected" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "a" in record.getMessage() and "Connection refused" in record.getMessage()


async def test_a_probe_ejection_says_what_the_probe_saw(caplog: pytest.LogCaptureFixture) -> None:
    async with sim_engines(2, "instant") as engines:
        cluster = Cluster([ReplicaState(ReplicaId(f"e{e.index}"), e.url) for e in engines])
        m = HealthMonitor(
            cluster, make_client("h1", Timeouts(0.5, 0.5, 0.5)), HealthSettings(failure_threshold=1)
        )
        await engines[0].set_faults(FaultConfig(unhealthy=True))
        with caplog.at_level(logging.WARNING, logger="kvgate.health"):
            assert not await m.probe(ReplicaId("e0"))
        await m.client.aclose()
    assert any(
        "e0 ejected" in r.getMessage() and "answered 503" in r.getMessage() for r in caplog.records
    )


async def test_a_stalled_replica_is_ejected_by_its_canary_and_the_request_moves() -> None:
    """`/health` still answers but the engine never does: the request that timed out
    there is innocent (the canary timed out too), so it goes to the other replica."""
    async with (
        sim_engines(2, "tiny") as engines,
        gateway(
            engines,
            timeouts={"response_headers_s": 0.3},
            health={"interval_s": 60, "canary_timeout_s": 0.3},
            models={"discover": False},
            routing={"policy": "round_robin"},
        ) as gw,
    ):
        engines[0].faults.config = FaultConfig(stall=0)
        state = gw.state
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            body = {
                "model": "kvgate-sim",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 2,
            }
            got = await asyncio.gather(*(http.post(CHAT, json=body) for _ in range(4)))
            assert [r.status_code for r in got] == [200] * 4
            assert {r.headers["x-kvgate-replica"] for r in got} == {"e1"}
        assert state.health.state(ReplicaId("e0")) is Health.EJECTED
        assert state.health.canaries_failed == 1  # concurrent timeouts shared one canary
        view = state.cluster.view()
        assert all(view.inflight(ReplicaId(f"e{i}")) == 0 for i in range(2))


async def test_a_stalled_last_replica_is_not_ejected() -> None:
    async with (
        sim_engines(1, "tiny", faults=FaultConfig(stall=0)) as engines,
        gateway(
            engines,
            timeouts={"response_headers_s": 0.3},
            health={"interval_s": 60, "canary_timeout_s": 0.3},
            models={"discover": False},
        ) as gw,
    ):
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            body = {
                "model": "kvgate-sim",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 2,
            }
            r = await http.post(CHAT, json=body)
        # Still a timeout to the client (nowhere else to go), and the message says why.
        assert r.status_code == 504 and "stalled" in r.text, r.text
        assert gw.state.health.state(ReplicaId("e0")) is Health.HEALTHY


async def test_a_stream_whose_replica_stalls_after_its_headers_fails_over() -> None:
    """Streams get their headers before the prefill: a stalled engine sends them and then
    nothing. The first chunk is read inside the attempt, so that case fails over too."""
    async with (
        sim_engines(2, "tiny") as engines,
        gateway(
            engines,
            timeouts={"read_s": 0.3, "response_headers_s": 0.3},
            health={"interval_s": 60, "canary_timeout_s": 0.3},
            models={"discover": False},
            routing={"policy": "round_robin"},
        ) as gw,
    ):
        engines[0].faults.config = FaultConfig(stall=0)
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            body = {
                "model": "kvgate-sim",
                "stream": True,
                "max_tokens": 3,
                "messages": [{"role": "user", "content": "x"}],
            }
            got = [await http.post(CHAT, json=body) for _ in range(3)]
        assert [r.status_code for r in got] == [200] * 3
        assert all(r.text.rstrip().endswith("data: [DONE]") for r in got)
        assert {r.headers["x-kvgate-replica"] for r in got} == {"e1"}
        assert gw.state.health.state(ReplicaId("e0")) is Health.EJECTED
        view = gw.state.cluster.view()
        assert all(view.inflight(ReplicaId(f"e{i}")) == 0 for i in range(2))
