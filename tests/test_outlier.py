"""Outlier detection (issue 44): a replica whose answers fail far more often than the rest
of the fleet's, over different requests, is ejected, with the DEFAULT thresholds
(5 consecutive 5xx, a 20% share at twice the fleet's from 20 requests, 30 s growing
ejections, at most 10% of the fleet, never the last in service). What is the request's
fault (the same request again, one failing on two replicas, a kind the replica always
fails while serving others) is never held against it."""

from __future__ import annotations

import asyncio
import re

import httpx

from gateway.cluster import Cluster
from gateway.health import Health, HealthMonitor
from gateway.settings import HealthSettings
from gateway.sim.faults import FaultConfig
from gateway.testing.clock import FakeClock
from gateway.testing.servers import gateway, sim_engines
from gateway.types import ReplicaId, ReplicaState
from gateway.upstream import Timeouts, make_client

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _monitor(n: int, clock: FakeClock | None = None) -> HealthMonitor:
    cluster = Cluster(
        [ReplicaState(ReplicaId(f"r{i}"), "http://127.0.0.1:9") for i in range(n)],
        clock=clock or FakeClock(),
    )
    return HealthMonitor(cluster, make_client("h1", Timeouts(0.5, 0.5, 0.5)), HealthSettings())


R0, R1, R2 = ReplicaId("r0"), ReplicaId("r1"), ReplicaId("r2")


def _body(i: int) -> bytes:
    return b'{"model":"m","messages":[{"role":"user","content":"request %d"}]}' % i


def _serve(m: HealthMonitor, replica: ReplicaId, start: int, n: int, fail_every: int) -> None:
    """`n` different requests; every `fail_every`-th is answered 500 (0: none)."""
    for i in range(start, start + n):
        if fail_every and i % fail_every == 0:
            m.answered_5xx(replica, CHAT, _body(i), 500)
        else:
            m.passive_success(replica, CHAT)


def test_defaults_are_envoy_like() -> None:
    o = HealthSettings().outlier
    assert (o.enabled, o.consecutive_5xx, o.interval_s) == (True, 5, 10.0)
    assert (o.base_ejection_s, o.max_ejection_s, o.max_ejection_share) == (30.0, 300.0, 0.1)


def test_five_consecutive_5xx_to_different_requests_eject() -> None:
    m = _monitor(3)
    for i in range(4):
        m.answered_5xx(R0, CHAT, _body(i), 500)
    assert m.state(R0) is Health.HEALTHY
    m.answered_5xx(R0, CHAT, _body(4), 500)
    assert m.state(R0) is Health.EJECTED and m.outlier_ejected(R0)
    assert m.ejections[(R0, "consecutive_5xx")] == 1


def test_the_same_request_failing_again_counts_once() -> None:
    m = _monitor(3)
    for _ in range(50):
        m.answered_5xx(R0, CHAT, _body(1), 500)
    assert m.state(R0) is Health.HEALTHY


def test_a_success_breaks_the_streak() -> None:
    m = _monitor(3)
    _serve(m, R1, 0, 30, 0)
    for i in range(40):
        if i % 4 == 3:
            m.passive_success(R0, CHAT)
        else:
            m.answered_5xx(R0, CHAT, _body(i), 500)
        if i == 3:
            assert m.state(R0) is Health.HEALTHY  # 3 failures, then a success
    # 75% failures over 40 requests still ejects it, by share.
    assert m.ejections[(R0, "failure_share")] == 1


def test_a_replica_failing_30_percent_stands_out_and_is_ejected() -> None:
    m = _monitor(3)
    _serve(m, R1, 0, 30, 0)
    _serve(m, R2, 0, 30, 0)
    _serve(m, R0, 0, 30, 3)  # a third of its different requests fail, never 5 in a row
    assert m.state(R0) is Health.EJECTED
    assert m.ejections[(R0, "failure_share")] == 1
    assert m.cluster.is_healthy(R1) and m.cluster.is_healthy(R2)


def test_a_fleet_wide_failure_ejects_nobody() -> None:
    m = _monitor(3)
    for r in (R0, R1, R2):
        _serve(m, r, 0, 60, 3)  # every replica fails a third: the model, not a replica
    assert all(m.state(r) is Health.HEALTHY for r in (R0, R1, R2))


def test_without_enough_requests_nothing_is_judged() -> None:
    m = _monitor(2)
    _serve(m, R1, 0, 30, 0)
    _serve(m, R0, 0, 12, 3)  # 4 of 12: too few requests to judge a share
    assert m.state(R0) is Health.HEALTHY


def test_a_request_failing_on_two_replicas_is_the_requests_fault() -> None:
    m = _monitor(3)
    for i in range(4):
        m.answered_5xx(R0, CHAT, _body(i), 500)
    # The same request fails on r1 too: excused on both, so r0's streak is 3, not 4.
    m.answered_5xx(R1, CHAT, _body(3), 500)
    m.answered_5xx(R0, CHAT, _body(10), 500)
    assert m.state(R0) is Health.HEALTHY and m.state(R1) is Health.HEALTHY
    m.answered_5xx(R0, CHAT, _body(3), 500)  # and it stays excused
    assert m.state(R0) is Health.HEALTHY


def test_a_kind_the_replica_always_fails_while_serving_others_is_not_held_against_it() -> None:
    """Issue 19's poison: r0 answers 500 to every completion and serves chat."""
    m = _monitor(2)
    for i in range(100):
        m.passive_success(R1, CHAT if i % 2 else COMPLETIONS)
        if i % 2:
            m.passive_success(R0, CHAT)
        else:
            m.answered_5xx(R0, COMPLETIONS, _body(i), 500)
    assert m.state(R0) is Health.HEALTHY


def test_503_is_load_not_sickness() -> None:
    m = _monitor(2)
    for i in range(50):
        m.answered_5xx(R0, CHAT, _body(i), 503)
    assert m.state(R0) is Health.HEALTHY


def test_never_the_last_in_service_and_at_most_the_ejection_share() -> None:
    m = _monitor(3)
    for r in (R0, R1, R2):
        for i in range(5):
            m.answered_5xx(r, CHAT, _body(100 * int(r[1]) + i), 500)
    # 10% of 3 replicas rounds to none: one may always be ejected, and only one.
    assert [m.outlier_ejected(r) for r in (R0, R1, R2)] == [True, False, False]
    m2 = _monitor(2)
    m2.record_failure(R1)
    m2.record_failure(R1)
    m2.record_failure(R1)  # probes took r1 out
    for i in range(10):
        m2.answered_5xx(R0, CHAT, _body(i), 500)
    assert m2.state(R0) is Health.HEALTHY  # the last in service stays


def test_ejections_grow_and_end_through_half_open() -> None:
    clock = FakeClock()
    m = _monitor(2, clock)
    for i in range(5):
        m.answered_5xx(R0, CHAT, _body(i), 500)
    assert m.state(R0) is Health.EJECTED
    clock.advance(29.0)
    m.record_success(R0, probe=True)
    assert m.state(R0) is Health.EJECTED  # 30 s the first time
    clock.advance(1.0)
    m.record_success(R0, probe=True)
    m.record_success(R0, probe=True)
    assert m.state(R0) is Health.HEALTHY and not m.outlier_ejected(R0)
    for i in range(5):
        m.answered_5xx(R0, CHAT, _body(10 + i), 500)
    clock.advance(30.0)
    m.record_success(R0, probe=True)
    assert m.state(R0) is Health.EJECTED  # 60 s the second time
    assert m.ejections[(R0, "consecutive_5xx")] == 2


def test_the_share_is_taken_over_a_window() -> None:
    clock = FakeClock()
    m = _monitor(2, clock)
    _serve(m, R1, 0, 30, 0)
    _serve(m, R0, 0, 30, 3)
    assert m.state(R0) is Health.EJECTED
    m2 = _monitor(2, clock)
    _serve(m2, R1, 0, 30, 0)
    for i in range(30):
        clock.advance(1.0)  # one request a second: the 10 s window never holds 20
        _serve(m2, R0, i, 1, 3)
    assert m2.state(R0) is Health.HEALTHY


# -- through the proxy, real sim engines, default thresholds ---------------------------


async def test_core_dead_engine_health_503_metrics_200_is_taken_out_of_service() -> None:
    """vLLM whose engine core died: `/health` 503, `/metrics` still 200. Scrapes (every
    0.1 s, far more often than probes) must not reset the probe failures."""
    async with sim_engines(2, "instant") as engines:
        await engines[0].set_faults(FaultConfig(unhealthy=True))
        async with (
            gateway(
                engines,
                health={"interval_s": 0.3},  # default failure_threshold (3)
                scrape={"interval_s": 0.1, "stale_after_s": 1.0},
                models={"discover": False},
            ) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
        ):
            assert (await http.get("/metrics")).status_code == 200
            for _ in range(100):
                if not gw.state.cluster.is_healthy(ReplicaId("e0")):
                    break
                await asyncio.sleep(0.1)
            assert gw.state.health.state(ReplicaId("e0")) is Health.EJECTED
            text = (await http.get("/metrics")).text
    assert 'kvgate_replica_ejections_total{reason="probe",replica="e0"} 1.0' in text
    assert 'kvgate_replica_healthy{replica="e0"} 0.0' in text
    assert 'kvgate_replica_ejected{replica="e0"} 0.0' in text  # a probe ejection, not an outlier


async def test_an_engine_answering_500_to_30_percent_is_ejected_by_default() -> None:
    async with sim_engines(2, "instant") as engines:
        await engines[0].set_faults(FaultConfig(error=500, error_rate=0.3))
        async with (
            gateway(
                engines,
                health={"interval_s": 60},
                models={"discover": False},
                routing={"policy": "round_robin"},
            ) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
        ):
            got = []
            for i in range(160):
                body = {
                    "model": "kvgate-sim",
                    "messages": [{"role": "user", "content": f"question {i}"}],
                    "max_tokens": 2,
                }
                r = await http.post(CHAT, json=body)
                got.append((r.status_code, r.headers.get("x-kvgate-replica")))
            text = (await http.get("/metrics")).text
        assert gw.state.health.outlier_ejected(ReplicaId("e0"))
        assert gw.state.cluster.is_healthy(ReplicaId("e1"))
        # Once it is out, the rest of the requests all succeed on e1.
        assert got[-20:] == [(200, "e1")] * 20
    assert 'kvgate_replica_ejected{replica="e0"} 1.0' in text
    assert 'kvgate_replica_ejected{replica="e1"} 0.0' in text
    assert re.search(
        r'kvgate_replica_ejections_total\{reason="(failure_share|consecutive_5xx)",'
        r'replica="e0"\} 1\.0',
        text,
    ), text
