"""Prefill budget: requests count against `max_prefill_tokens` from admission to their first
response byte, and leave it exactly once on every exit path."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.admission.config import AdmissionSettings, SaturationThresholds
from gateway.admission.gate import AdmissionGate
from gateway.admission.saturation import is_saturated
from gateway.sim.faults import FaultConfig
from gateway.sim.profiles import PROFILES
from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway, gateway, sim_engines
from gateway.types import ClusterView, EngineLoad, ReplicaId, ReplicaState, RouteRequest, SessionKey

A = ReplicaId("a")


class Cluster:
    """One replica's in-flight count and a fresh idle load, published as frozen views."""

    def __init__(self) -> None:
        self.inflight: dict[ReplicaId, int] = {A: 0}
        self.load = EngineLoad(waiting=0, running=1, kv_usage=0.1, scraped_at=0.0)

    def view(self) -> ClusterView:
        state = ReplicaState(id=A, url="http://a", healthy=True, load=self.load)
        return ClusterView(replicas=(state,), now=0.0, in_flight=self.inflight)


def _req(rid: str, cls: str = "batch", prompt: int = 100) -> RouteRequest:
    return RouteRequest(
        request_id=rid,
        model="m",
        session_key=SessionKey(rid),
        prefix_hashes=(1, 2),
        prompt_tokens=prompt,
        max_tokens=8,
        priority_class=cls,
    )


def _gate(cluster: Cluster, policy: object | None = None, **kw: Any) -> AdmissionGate:
    raw: dict[str, Any] = {"enabled": True, "recheck_interval_s": 0.01, "max_wait_s": 2.0}
    raw.update(kw)
    return AdmissionGate(
        AdmissionSettings.model_validate(raw),
        cluster.view,
        registry=CollectorRegistry(),
        policy=policy,
        clock=lambda: 0.0,
    )


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


MODEL = "kvgate-sim"
T = SaturationThresholds(max_waiting=None, max_kv_usage=None, max_prefill_tokens=2048)


def _load() -> EngineLoad:
    return EngineLoad(waiting=0, running=4, kv_usage=0.1, scraped_at=1.0)


@pytest.mark.parametrize(
    ("prefilling", "tokens", "saturated"),
    [
        (0, 12_000, False),  # alone, a prefill larger than a step still goes
        (1024, 1024, False),
        (1024, 1025, True),
        (2048, 0, False),
        (2049, 0, True),
    ],
)
def test_prefill_budget_pure(prefilling: int, tokens: int, saturated: bool) -> None:
    assert is_saturated(_load(), 3, 3, T, 0, 0, prefilling, tokens) is saturated


def test_held_back_prefill_budget_keeps_the_chunk() -> None:
    t = SaturationThresholds(max_prefill_tokens=2048, prefill_chunk_tokens=1024)
    held = t.held_back(0.5)
    assert (held.max_prefill_tokens, held.prefill_chunk_tokens) == (1024, 1024)


def _prefill_gate(cluster: Cluster) -> AdmissionGate:
    return _gate(
        cluster,
        saturation={
            "max_waiting": None,
            "max_kv_usage": None,
            "max_prefill_tokens": 2048,
            "prefill_chunk_tokens": 1024,
        },
        classes=[{"name": "interactive"}, {"name": "batch", "holdback": 0.5}],
        default_class="batch",
    )


async def test_low_class_fills_only_its_share_of_a_step() -> None:
    cluster = Cluster()
    gate = _prefill_gate(cluster)
    long1 = _req("long1", "batch", prompt=12_000)
    assert not gate.must_wait(long1, A, cluster.view())
    cluster.inflight[A] += 1
    assert gate.prefill_tokens_in_flight(A) == 1024  # capped at one step's chunk
    short_b = _req("short_b", "batch", prompt=300)
    assert gate.must_wait(short_b, A, cluster.view())  # batch's share (1024) is used up
    short_i = _req("short_i", "interactive", prompt=300)
    assert not gate.must_wait(short_i, A, cluster.view())  # the rest of the step is its
    cluster.inflight[A] += 1
    assert gate.prefill_tokens_in_flight(A) == 1324
    waiting = asyncio.create_task(gate.wait(short_b, A))
    await _settle()
    assert not waiting.done()
    gate.first_byte(short_i, A)  # its prefill ended; batch still over its share
    await _settle()
    assert not waiting.done()
    gate.first_byte(long1, A)  # the long prefill ended: the batch short goes
    await asyncio.wait_for(waiting, 1.0)
    assert gate.prefill_tokens_in_flight(A) == 300
    gate.first_byte(long1, A)  # idempotent
    assert gate.prefill_tokens_in_flight(A) == 300
    gate.finished(short_b, A)  # no first byte (e.g. failed): finishing frees it
    for r in (long1, short_i):
        gate.finished(r, A)
    assert gate.prefill_tokens_in_flight(A) == 0


async def test_cached_prefix_is_not_counted_as_prefill() -> None:
    class Index:
        def choose(self, request: RouteRequest, view: object) -> None:  # pragma: no cover
            raise AssertionError("not used")

        def cached_tokens(self, request: RouteRequest, replica: ReplicaId) -> int:
            return 11_900

    cluster = Cluster()
    gate = _gate(
        cluster,
        Index(),
        saturation={"max_waiting": None, "max_kv_usage": None, "max_prefill_tokens": 2048},
    )
    warm = _req("warm", prompt=12_000)
    assert not gate.must_wait(warm, A, cluster.view())
    assert gate.prefill_tokens_in_flight(A) == 100


# ---- end to end: exactly one first-byte signal per request, counter back to 0 ----------

ADMISSION: dict[str, Any] = {
    "enabled": True,
    "saturation": {"max_waiting": None, "max_kv_usage": None, "max_prefill_tokens": 100_000},
}


def _body(**extra: Any) -> dict[str, Any]:
    msgs = [{"role": "user", "content": "hello there"}]
    return {"model": MODEL, "messages": msgs, "max_tokens": 3, **extra}


@pytest.fixture
async def engines() -> AsyncIterator[list[SimEngine]]:
    async with sim_engines(3, "instant") as engines:
        yield engines


def _spy(gw: RunningGateway) -> tuple[AdmissionGate, Counter[str]]:
    gate = gw.state.admission
    assert isinstance(gate, AdmissionGate)
    calls: Counter[str] = Counter()
    real = gate.first_byte

    def first_byte(request: RouteRequest, replica: ReplicaId | None) -> None:
        calls[request.request_id] += 1
        real(request, replica)

    gate.first_byte = first_byte  # type: ignore[method-assign]
    return gate, calls


def _drained(gate: AdmissionGate, gw: RunningGateway) -> bool:
    return all(
        gate.prefill_tokens_in_flight(r) == 0 and n == 0
        for r, n in gw.state.cluster.in_flight.items()
    )


async def test_every_exit_path_signals_once_and_drains(engines: list[SimEngine]) -> None:
    async with (
        gateway(engines, admission=ADMISSION, health={"enabled": False}) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        gate, calls = _spy(gw)

        async def post(rid: str, session: str, **extra: Any) -> httpx.Response:
            headers = {"x-request-id": rid, "x-session-id": session}
            return await http.post("/v1/chat/completions", json=_body(**extra), headers=headers)

        assert (await post("ok", "s")).status_code == 200
        assert (await post("ok-stream", "s", stream=True)).status_code == 200
        owner = (await post("probe", "f")).headers["x-kvgate-replica"]
        engine = engines[int(owner.removeprefix("e"))]
        await engine.set_faults(FaultConfig(error=500))  # relayed, not retried
        assert (await post("err", "f")).status_code == 500
        await engine.set_faults(FaultConfig(error=503))  # retried on another replica
        retried = await post("retry", "f", stream=True)
        assert retried.status_code == 200 and retried.headers["x-kvgate-replica"] != owner
        for e in engines:
            await e.set_faults(FaultConfig(error=503))
        assert (await post("all-down", "f")).status_code == 502
        assert _drained(gate, gw)
        ids = ("ok", "ok-stream", "probe", "err", "retry", "all-down")
        assert {i: calls[i] for i in ids} == dict.fromkeys(ids, 1)


async def test_prefill_ends_at_first_byte_and_disconnect_drains() -> None:
    engine = SimEngine(PROFILES["tiny"].scaled(decode_base_s=0.05), index=0)
    await engine.start()
    try:
        async with (
            gateway([engine], admission=ADMISSION, health={"enabled": False}) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
        ):
            gate, calls = _spy(gw)
            e0 = ReplicaId("e0")
            body = _body(stream=True, max_tokens=200)
            headers = {"x-request-id": "leaver"}
            async with http.stream(
                "POST", "/v1/chat/completions", json=body, headers=headers
            ) as resp:
                chunks = resp.aiter_bytes()
                assert await anext(chunks)
                # Still decoding, but no longer prefilling.
                assert gw.state.cluster.in_flight[e0] == 1
                assert gate.prefill_tokens_in_flight(e0) == 0
                assert calls["leaver"] == 1
            for _ in range(200):
                if gw.state.cluster.in_flight[e0] == 0:
                    break
                await asyncio.sleep(0.01)
            assert _drained(gate, gw)
            assert calls["leaver"] == 1
    finally:
        await engine.stop()
