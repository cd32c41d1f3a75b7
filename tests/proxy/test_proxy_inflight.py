"""In-flight counters return to zero on every exit path; retries fail over correctly."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from gateway.app import build_app
from gateway.hooks import RequestOutcome
from gateway.settings import load_settings
from gateway.sim.faults import FaultConfig
from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway, gateway, replica_config

MODEL = "kvgate-sim"


def body(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        **extra,
    }


def all_zero(gw: RunningGateway) -> bool:
    return all(n == 0 for n in gw.state.cluster.in_flight.values())


@pytest.fixture
async def gw(engines: list[SimEngine]) -> AsyncIterator[RunningGateway]:
    # Active probes off: only the proxied requests drive health in these tests.
    async with gateway(engines, health={"enabled": False, "failure_threshold": 100}) as gw:
        yield gw


@pytest.fixture
async def http(gw: RunningGateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
        yield http


async def owner_of(http: httpx.AsyncClient, session: str) -> str:
    resp = await http.post("/v1/chat/completions", json=body(), headers={"x-session-id": session})
    return resp.headers["x-kvgate-replica"]


def engine_of(engines: list[SimEngine], replica: str) -> SimEngine:
    return engines[int(replica.removeprefix("e"))]


async def test_success_paths(gw: RunningGateway, http: httpx.AsyncClient) -> None:
    for stream in (False, True):
        resp = await http.post("/v1/chat/completions", json=body(stream=stream))
        assert resp.status_code == 200
    assert all_zero(gw)


async def test_upstream_error_is_relayed_and_released(
    gw: RunningGateway, http: httpx.AsyncClient, engines: list[SimEngine]
) -> None:
    replica = await owner_of(http, "err")
    await engine_of(engines, replica).set_faults(FaultConfig(error=500))
    resp = await http.post("/v1/chat/completions", json=body(), headers={"x-session-id": "err"})
    assert (
        resp.status_code == 500 and resp.headers["x-kvgate-replica"] == replica
    )  # 500 is not retried
    assert all_zero(gw)


async def test_retry_on_503_goes_to_another_replica(
    gw: RunningGateway, http: httpx.AsyncClient, engines: list[SimEngine]
) -> None:
    replica = await owner_of(http, "retry")
    await engine_of(engines, replica).set_faults(FaultConfig(error=503))
    outcomes: list[RequestOutcome] = []
    gw.state.observers.append(outcomes.append)
    resp = await http.post("/v1/chat/completions", json=body(), headers={"x-session-id": "retry"})
    assert resp.status_code == 200 and resp.headers["x-kvgate-replica"] != replica
    assert all_zero(gw)
    assert outcomes[0].retries == 1 and outcomes[0].replica == resp.headers["x-kvgate-replica"]
    text = gw.state.metrics.render().decode()
    assert 'kvgate_retries_total{reason="upstream_unavailable"} 1.0' in text
    assert (
        f'kvgate_upstream_failures_total{{kind="upstream_unavailable",replica="{replica}"}} 1.0'
        in text
    )


async def test_retry_on_connection_refused(
    gw: RunningGateway, http: httpx.AsyncClient, engines: list[SimEngine]
) -> None:
    replica = await owner_of(http, "refused")
    await engine_of(engines, replica).set_faults(FaultConfig(refuse=True))
    resp = await http.post(
        "/v1/chat/completions", json=body(stream=True), headers={"x-session-id": "refused"}
    )
    assert resp.status_code == 200 and resp.headers["x-kvgate-replica"] != replica
    assert all_zero(gw)


async def test_all_replicas_failing_is_bounded(
    gw: RunningGateway, http: httpx.AsyncClient, engines: list[SimEngine]
) -> None:
    for engine in engines:
        await engine.set_faults(FaultConfig(error=503))
    seen: list[int] = []
    for engine in engines:
        seen.append(engine.faults.injected_errors)
    resp = await http.post("/v1/chat/completions", json=body())
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "upstream_unavailable"
    tried = sum(e.faults.injected_errors for e in engines) - sum(seen)
    assert tried == 3  # max_attempts, each on a different replica
    assert all(e.faults.injected_errors <= 1 for e in engines)
    assert all_zero(gw)


async def test_retries_never_repeat_a_replica(engines: list[SimEngine]) -> None:
    for engine in engines:
        await engine.set_faults(FaultConfig(error=502))
    async with gateway(engines, retries={"max_attempts": 10}, health={"enabled": False}) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as http:
            resp = await http.post("/v1/chat/completions", json=body())
        assert resp.status_code == 502
        assert [e.faults.injected_errors for e in engines] == [1, 1, 1]
        assert all_zero(gw)


async def test_openai_client_sees_success_after_failover(
    gw: RunningGateway, engines: list[SimEngine]
) -> None:
    await engines[0].set_faults(FaultConfig(refuse=True))
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client:
        for i in range(6):
            out = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=2
            )
            assert out.choices[0].message.content
    assert all_zero(gw)


async def test_cancellation_releases_everything(engines: list[SimEngine]) -> None:
    """The handler task cancelled from outside (server shutdown) mid-stream."""
    slow = [SimEngine(engines[0].profile.scaled(instant=False, decode_base_s=0.05), index=9)]
    await slow[0].start()
    try:
        settings = load_settings(replicas=replica_config(slow), health={"enabled": False})
        app = build_app(settings)
        state = app.state.gateway
        sent: list[dict[str, Any]] = []
        payload = b'{"model": "kvgate-sim", "stream": true, "max_tokens": 500, "messages": [{"role": "user", "content": "x"}]}'
        messages = [{"type": "http.request", "body": payload, "more_body": False}]
        never = asyncio.Event()

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await never.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions",
            "headers": [(b"content-type", b"application/json")],
            "query_string": b"",
            "root_path": "",
            "scheme": "http",
            "server": ("test", 80),
            "client": ("127.0.0.1", 1),
            "http_version": "1.1",
            "asgi": {"version": "3.0"},
        }
        async with app.router.lifespan_context(app):
            task = asyncio.create_task(app(scope, receive, send))
            for _ in range(200):
                if any(m["type"] == "http.response.body" for m in sent):
                    break
                await asyncio.sleep(0.02)
            assert state.cluster.in_flight["e9"] == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert state.cluster.in_flight["e9"] == 0
        for _ in range(100):
            if slow[0].aborted:
                break
            await asyncio.sleep(0.02)
        assert slow[0].aborted == 1
    finally:
        await slow[0].stop()
