"""End to end: openai client -> gateway with admission -> simulated engines on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from gateway.admission.gate import AdmissionGate
from gateway.sim.profiles import PROFILES
from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway, gateway, replica_config
from gateway.types import ReplicaId, RouteRequest, SessionKey

MODEL = "kvgate-sim"
E0 = ReplicaId("e0")
# Stands for a request that held the replica; only its end is reported to the gate.
PHANTOM = RouteRequest(request_id="phantom", model=MODEL, session_key=SessionKey("phantom"))
# Decode steps of ~20 ms: a request with max_tokens=10 holds its replica for ~0.2 s.
SLOW = PROFILES["tiny"].scaled(decode_base_s=0.02, max_num_seqs=4)


def admission(**overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "enabled": True,
        # No scraper in these tests: the gateway's own in-flight count decides.
        "saturation": {"max_inflight": 1, "max_waiting": None, "max_kv_usage": None},
        "max_wait_s": 10.0,
        "recheck_interval_s": 0.02,
    }
    cfg.update(overrides)
    return cfg


@pytest.fixture
async def engine() -> AsyncIterator[SimEngine]:
    eng = SimEngine(SLOW, index=0)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


def _gate(gw: RunningGateway) -> AdmissionGate:
    gate = gw.state.admission
    assert isinstance(gate, AdmissionGate)
    return gate


def _msg(text: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": text}]


async def _wait_queued(gate: AdmissionGate, n: int) -> None:
    for _ in range(200):
        if len(gate.room) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"expected {n} queued, have {len(gate.room)}")


async def test_queued_requests_released_by_class_then_size(engine: SimEngine) -> None:
    async with gateway([engine], admission=admission()) as gw:
        gate = _gate(gw)
        done: list[str] = []
        async with openai.AsyncOpenAI(
            base_url=gw.url + "/v1", api_key="k", max_retries=0
        ) as client:

            async def ask(name: str, text: str, priority: str | None, max_tokens: int) -> None:
                headers = {"X-Priority": priority} if priority else {}
                await client.chat.completions.create(
                    model=MODEL, messages=_msg(text), max_tokens=max_tokens, extra_headers=headers
                )
                done.append(name)

            # Hold the replica's only place as an in-flight request would, so that the
            # queue builds deterministically however slow this machine is.
            cluster = gw.state.cluster
            cluster.acquire(E0)
            tasks = [asyncio.create_task(ask("batch", "b " * 50, "batch", 3))]
            await _wait_queued(gate, 1)
            tasks.append(asyncio.create_task(ask("default-long", "x " * 400, None, 3)))
            await _wait_queued(gate, 2)
            tasks.append(asyncio.create_task(ask("default-short", "y", None, 3)))
            await _wait_queued(gate, 3)
            tasks.append(asyncio.create_task(ask("interactive", "z " * 300, "interactive", 3)))
            await _wait_queued(gate, 4)
            assert done == []
            cluster.release(E0)
            gate.finished(PHANTOM, E0)
            await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert done == ["interactive", "default-short", "default-long", "batch"]
        assert len(gate.room) == 0
        async with httpx.AsyncClient(base_url=gw.url) as http:
            metrics = (await http.get("/metrics")).text
        assert 'kvgate_admission_wait_seconds_count{outcome="released",priority_class="batch"}' in (
            metrics
        )
        assert 'kvgate_admission_queue_depth{priority_class="interactive"} 0.0' in metrics


async def test_overflow_and_timeout_answer_429_with_retry_after(engine: SimEngine) -> None:
    cfg = admission(max_queue=1, max_wait_s=0.3, retry_after_s=3)
    async with (
        gateway([engine], admission=cfg) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        gate = _gate(gw)

        def body(max_tokens: int) -> dict[str, Any]:
            return {"model": MODEL, "messages": _msg("hi"), "max_tokens": max_tokens}

        blocker = asyncio.create_task(http.post("/v1/chat/completions", json=body(40)))
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(http.post("/v1/chat/completions", json=body(2)))
        await _wait_queued(gate, 1)
        full = await http.post("/v1/chat/completions", json=body(2))
        assert full.status_code == 429
        assert full.headers["retry-after"] == "3"
        err = full.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
        timed_out = await queued  # waited 0.3 s behind a ~0.8 s blocker
        assert timed_out.status_code == 429 and "waited" in timed_out.json()["error"]["message"]
        assert (await blocker).status_code == 200
        # Once the replica is free again the fast path serves at once.
        assert (await http.post("/v1/chat/completions", json=body(1))).status_code == 200
        assert len(gate.room) == 0


async def test_client_disconnect_while_queued_leaves_at_once(engine: SimEngine) -> None:
    async with (
        gateway([engine], admission=admission()) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        gate = _gate(gw)
        gw.state.cluster.acquire(E0)  # the replica's only place is taken
        stays = asyncio.create_task(
            http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": _msg("I stay"), "max_tokens": 2},
            )
        )
        await _wait_queued(gate, 1)
        leaving = asyncio.create_task(
            http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": _msg("I will leave"), "max_tokens": 2},
                headers={"X-Request-Id": "leaver"},
            )
        )
        await _wait_queued(gate, 2)
        leaving.cancel()  # closes the connection: the gateway sees http.disconnect
        with pytest.raises(asyncio.CancelledError):
            await leaving
        for _ in range(100):
            if len(gate.room) == 1:
                break
            await asyncio.sleep(0.01)
        assert len(gate.room) == 1  # left while the replica is still full
        assert not stays.done()
        gw.state.cluster.release(E0)
        gate.finished(PHANTOM, E0)
        assert (await stays).status_code == 200
        assert all("leaver" not in r.request_id for r in engine.request_log)
        metrics = (await http.get("/metrics")).text
        assert 'outcome="disconnect",priority_class="default"} 1.0' in metrics
        assert gw.state.cluster.in_flight[E0] == 0


async def test_priority_field_mapped_for_priority_replicas_and_stripped_elsewhere() -> None:
    prio = SimEngine(PROFILES["instant"], index=0, priority_scheduling=True)
    plain = SimEngine(PROFILES["instant"], index=1)
    for e in (prio, plain):
        await e.start()
    try:
        replicas = replica_config([prio], priority_scheduling=True) + replica_config([plain])
        routing = {"policy": "round_robin"}
        # The class's priority as it is (test_engine_order: with the size rank under it).
        order = {"shortest_prefill_first": False}
        async with (
            gateway(
                [prio, plain],
                replicas=replicas,
                routing=routing,
                admission=admission(),
                engine_priority=order,
            ) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
        ):
            for _ in range(4):
                r = await http.post(
                    "/v1/chat/completions",
                    json={
                        "model": MODEL,
                        "messages": _msg("p"),
                        "max_tokens": 1,
                        "priority": "batch",
                    },
                )
                assert r.status_code == 200, r.text  # the plain engine would 400 on priority
            bad = await http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": _msg("p"), "max_tokens": 1},
                headers={"X-Priority": "platinum"},
            )
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-priority"
        assert prio.request_log and {r.priority for r in prio.request_log} == {2}
        assert plain.request_log and {r.priority for r in plain.request_log} == {0}
    finally:
        for e in (prio, plain):
            await e.stop()


async def test_disabled_admission_installs_nothing(engine: SimEngine) -> None:
    async with gateway([engine]) as gw:
        assert gw.state.admission is None
        async with httpx.AsyncClient(base_url=gw.url) as http:
            metrics = (await http.get("/metrics")).text
        assert "kvgate_admission" not in metrics
