"""`kvgate doctor --gateway` sees through the gateway (issue 46): a replica failing a fifth
of its requests with 503 (retried, so no client sees it), requests waiting in admission
queues and answered 429, against a real gateway on simulated engines; ejected replicas and
replicas without engine load from an exposition with the gateway's series."""

from __future__ import annotations

import asyncio
import time

import openai

from gateway.doctor.checks import diagnose
from gateway.doctor.cli import collect
from gateway.doctor.findings import Hints
from gateway.doctor.probe import parse_gateway
from gateway.doctor.through import ERROR_MIN_ATTEMPTS, check_through_gateway, failures
from gateway.sim.faults import FaultConfig
from gateway.testing.servers import gateway, replica_config, sim_engines


async def test_a_failing_replica_and_the_admission_queue_are_findings() -> None:
    async with sim_engines(3, "tiny") as engines:
        await engines[1].set_faults(FaultConfig(error=503, error_rate=0.2))
        async with (
            gateway(
                engines,
                replicas=replica_config(engines),
                admission={"enabled": True, "saturation": {"max_inflight": 1}, "max_queue": 4},
            ) as gw,
            openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="-", max_retries=0) as client,
        ):
            done = asyncio.Event()

            async def worker(n: int) -> None:
                turn = 0
                while not done.is_set():
                    turn += 1
                    try:
                        await client.chat.completions.create(
                            model="kvgate-sim",
                            messages=[{"role": "user", "content": f"w{n} t{turn} " * 20}],
                            max_tokens=8,
                            extra_headers={"X-Session-Id": f"w{n}-t{turn}"},
                        )
                    except openai.APIError:
                        await asyncio.sleep(0.05)  # a 429: try again shortly, not in a spin

            workers = [asyncio.create_task(worker(n)) for n in range(16)]
            try:
                await asyncio.sleep(5.0)  # the doctor reads while the queues are full
                # A busy host serves fewer requests in that time: read again (bounded) until
                # e1 has had the attempts a share needs.
                deadline = time.monotonic() + 20.0
                while True:
                    series, view = await collect([], gw.url, samples=1, interval=0.0, timeout=5.0)
                    seen = failures(view).get("e1", (0.0, 0.0))[1] if view is not None else 0.0
                    if seen >= ERROR_MIN_ATTEMPTS or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(1.0)
            finally:
                done.set()
                await asyncio.gather(*workers)
    assert view is not None and view.error is None
    result = diagnose(series, view, Hints())
    by_code = {(f.code, f.replica): f for f in result.findings}
    bad, attempts = failures(view)["e1"]
    errors = [f for f in result.findings if f.code == "replica_errors"]
    # Only the faulty engine, and with its numbers and the way out.
    assert [f.replica for f in errors] == ["e1"], errors
    assert 0.05 <= bad / attempts <= 0.5, (bad, attempts)
    assert f"{bad:.0f} of {attempts:.0f} attempts failed" in errors[0].evidence[0]
    assert "replicas" in errors[0].suggestion
    # 16 clients on 3 slots with room for 4 in the queue: it is full, the rest get 429.
    queueing = by_code[("admission_queueing", "gateway")]
    assert "admission.saturation.max_inflight" in queueing.suggestion
    rejects = by_code[("admission_rejects", "gateway")]
    assert "queue_full" in rejects.evidence[0] and "admission.max_queue" in rejects.suggestion


EXPOSITION = """\
# TYPE kvgate_replica_healthy gauge
kvgate_replica_healthy{replica="a"} 1.0
kvgate_replica_healthy{replica="b"} 0.0
kvgate_replica_healthy{replica="c"} 1.0
# TYPE kvgate_replica_ejected gauge
kvgate_replica_ejected{replica="a"} 0.0
kvgate_replica_ejected{replica="b"} 1.0
kvgate_replica_ejected{replica="c"} 0.0
# TYPE kvgate_replica_ejections_total counter
kvgate_replica_ejections_total{replica="b",reason="stalled"} 2.0
kvgate_replica_ejections_total{replica="b",reason="probe"} 1.0
kvgate_replica_ejections_total{replica="a",reason="probe"} 1.0
# TYPE kvgate_replica_engine_load_missing gauge
kvgate_replica_engine_load_missing{replica="a"} 0.0
kvgate_replica_engine_load_missing{replica="b"} 0.0
kvgate_replica_engine_load_missing{replica="c"} 1.0
# TYPE kvgate_admission_queue_depth gauge
kvgate_admission_queue_depth{priority_class="default"} 0.0
"""


def test_ejected_replicas_and_missing_engine_load_from_the_exposition() -> None:
    view = parse_gateway("http://gw", EXPOSITION, 0.0)
    findings = {(f.code, f.replica): f for f in check_through_gateway(view)}
    assert set(findings) == {("replica_ejected", "b"), ("no_engine_load", "c")}
    ejected = findings[("replica_ejected", "b")]
    assert "probe 1, stalled 2" in ejected.evidence[1]
    assert "health.cooldown_s" in ejected.suggestion
    assert "replicas[].engine" in findings[("no_engine_load", "c")].suggestion


def test_without_the_ejection_series_a_replica_at_healthy_0_is_ejected() -> None:
    text = 'kvgate_replica_healthy{replica="a"} 1\nkvgate_replica_healthy{replica="b"} 0\n'
    findings = check_through_gateway(parse_gateway("http://gw", text, 0.0))
    assert [(f.code, f.replica) for f in findings] == [("replica_ejected", "b")]
    assert findings[0].evidence[0] == "kvgate_replica_healthy 0"


def test_a_quiet_healthy_gateway_has_nothing_to_say() -> None:
    text = (
        'kvgate_replica_healthy{replica="a"} 1\n'
        'kvgate_requests_total{endpoint="chat",replica="a",status="200"} 500\n'
        'kvgate_upstream_failures_total{replica="a",kind="upstream_503"} 3\n'
        'kvgate_admission_queue_depth{priority_class="default"} 0\n'
        'kvgate_admission_rejected_total{priority_class="default",reason="queue_full"} 0\n'
    )
    assert check_through_gateway(parse_gateway("http://gw", text, 0.0)) == []
