"""The doctor's probes against real parts: a gateway's own /metrics after real requests
through it, an address nothing listens on, a body that is no exposition; and the
hot-replica rule at its boundaries."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from gateway.doctor.checks import check_cluster
from gateway.doctor.findings import HOT_FACTOR, HOT_MIN, Hints
from gateway.doctor.probe import parse_engine, parse_gateway, probe_gateway
from gateway.testing.servers import gateway, sim_engines

MODEL = "kvgate-sim"


async def test_a_gateways_exposition_after_real_requests() -> None:
    async with sim_engines(2, "instant") as engines, gateway(engines) as gw:
        async with openai.AsyncOpenAI(
            base_url=gw.url + "/v1", api_key="k", max_retries=0
        ) as client:
            served: dict[str, int] = {}
            for i in range(6):
                raw = await client.chat.completions.with_raw_response.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"question {i}"}],
                    max_tokens=2,
                )
                replica = raw.headers["x-kvgate-replica"]
                served[replica] = served.get(replica, 0) + 1
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(
                    model="no-such-model", messages=[{"role": "user", "content": "x"}]
                )
        async with httpx.AsyncClient(timeout=5) as http:
            snap = await probe_gateway(http, gw.url)
    assert snap.error is None
    answered = {r: sum(by_status.values()) for r, by_status in snap.requests.items() if r}
    assert {r: int(n) for r, n in answered.items()} == served
    assert all(set(by_status) == {"200"} for r, by_status in snap.requests.items() if r)
    assert sum(snap.decisions.values()) >= 6  # one routing decision per proxied request
    assert set(snap.healthy) == {"e0", "e1"} and all(v == 1.0 for v in snap.healthy.values())
    assert all(v == 0.0 for v in snap.in_flight.values())  # every slot released
    assert not snap.upstream_failures or all(v == 0 for v in snap.upstream_failures.values())


async def test_a_gateway_that_does_not_answer_is_an_error_and_a_finding() -> None:
    async with httpx.AsyncClient(timeout=2) as http:
        snap = await probe_gateway(http, "http://127.0.0.1:9")
    assert snap.error is not None
    findings = check_cluster({}, snap, Hints())
    assert [f.code for f in findings] == ["gateway_unreachable"]
    assert findings[0].evidence[0].startswith("GET http://127.0.0.1:9/metrics")


def test_text_that_is_no_exposition_is_an_error_not_a_crash() -> None:
    snap = parse_gateway("http://g", 'kvgate_in_flight{replica="a" 1\n', time.time())
    assert snap.error is not None and not snap.requests


def _engine(url: str, running: int, waiting: int) -> tuple[str, object]:
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}\n'
    )
    return url, parse_engine(url, text, 0.0)


@pytest.mark.parametrize(
    ("loads", "hot"),
    [
        # The busiest is hot at HOT_MIN or more and at HOT_FACTOR x the others' mean + 2.
        ((int(HOT_MIN) - 1, 0, 0), False),
        ((int(HOT_MIN), 0, 0), True),
        ((9, 4, 4), False),  # 9 < 2 x 4 + 2
        ((10, 4, 4), True),  # at 2 x mean + 2
        ((12, 12, 12), False),  # evenly busy
        ((50,), False),  # one replica: nothing to compare with
    ],
)
def test_one_hot_replica_at_the_boundaries(loads: tuple[int, ...], hot: bool) -> None:
    assert HOT_FACTOR == 2.0  # the table above is written for it
    latest = dict(_engine(f"http://e{i}", load, 0) for i, load in enumerate(loads))
    findings = check_cluster(latest, None, Hints())  # type: ignore[arg-type]
    assert [f.code for f in findings] == (["hot_replica"] if hot else [])
    if hot:
        assert findings[0].replica == "http://e0"
