"""Engine facts read by the gateway itself (gateway.facts): at start, again on re-admission,
and acted on (the priority direction with `engine: auto`, the capacity of an engine that
serves no metrics)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from openai import AsyncOpenAI

from gateway.facts.read import from_server_info, from_vllm
from gateway.facts.service import EngineFactsService
from gateway.sim.faults import FaultConfig
from gateway.sim.profiles import PROFILES
from gateway.testing.servers import gateway, replica_config, sim_engines
from gateway.types import ReplicaId

MODEL = "kvgate-sim"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engines"


async def _until(check: object, timeout: float = 10.0) -> None:
    assert callable(check)
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.05)


def test_server_info_says_the_direction_only_when_it_has_the_flag() -> None:
    base = {"page_size": 1, "enable_metrics": False, "max_total_num_tokens": 500_000}
    default = from_server_info({**base, "schedule_low_priority_values_first": False})
    assert default is not None and default.runs_higher_first is True
    low = from_server_info({**base, "schedule_low_priority_values_first": True})
    assert low is not None and low.runs_higher_first is False
    unknown = from_server_info(base)
    assert unknown is not None and unknown.runs_higher_first is None
    assert (unknown.page_size, unknown.metrics_enabled, unknown.capacity_tokens) == (
        1,
        False,
        500_000,
    )
    assert from_server_info(["not", "a", "map"]) is None


def test_vllm_facts_from_the_recorded_kv_event_sources() -> None:
    body = json.loads((FIXTURES / "vllm-0.33.0" / "http.json").read_text())["kv_event_sources"]
    facts = from_vllm(body, {"data": [{"id": "base"}, {"id": "sql-adapter", "parent": "base"}]})
    assert facts.kind == "vllm" and facts.runs_higher_first is False
    assert facts.kv_events is not None and sorted(facts.kv_events) == ["0", "1"]
    assert facts.models == ("base", "sql-adapter")


async def _ranks(flag: bool) -> list[int]:
    """Priorities an SGLang sim (metrics off, so its kind is unknown to the scraper) got
    for a long uncached prompt and then a cached turn, behind `engine: auto`."""
    async with sim_engines(
        1,
        "instant",
        flavor="sglang",
        priority_scheduling=True,
        metrics_enabled=False,
        low_priority_first=flag,
    ) as engines:
        replicas = replica_config(engines, priority_scheduling=True)
        async with (
            gateway(engines, replicas=replicas) as gw,
            AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0) as client,
        ):
            facts: EngineFactsService = gw.state.extras["facts"]
            await _until(lambda: ReplicaId("e0") in facts.facts)
            history = " ".join(f"fact {i} is {i * 7}." for i in range(4000))
            await client.completions.create(model=MODEL, prompt=history, max_tokens=4)
            await client.completions.create(
                model=MODEL, prompt=history + " And fact 3?", max_tokens=4
            )
        return [r.priority for r in engines[0].request_log]


async def test_an_sglang_started_low_first_gets_lower_first_values_without_priority_order() -> None:
    # Lower first: the long uncached prefill ranks last (a positive value), the cached turn 0.
    low = await _ranks(True)
    assert low[0] >= 2 and low[1] == 0
    # SGLang's default (larger first), read from /server_info though /metrics is off: negated.
    default = await _ranks(False)
    assert default[0] <= -2 and default[1] == 0


async def test_facts_are_read_again_when_a_replica_comes_back_into_service() -> None:
    health = {"interval_s": 0.1, "timeout_s": 0.5, "cooldown_s": 0.2, "success_threshold": 1}
    async with (
        sim_engines(1, "instant", flavor="sglang") as engines,
        gateway(engines, health=health) as gw,
    ):
        facts: EngineFactsService = gw.state.extras["facts"]
        e0 = ReplicaId("e0")
        await _until(lambda: e0 in facts.facts)
        assert facts.runs_higher_first(e0) is True
        reads = facts.reads
        # The engine goes out of service and comes back started with the other flag.
        await engines[0].set_faults(FaultConfig(unhealthy=True))
        await _until(lambda: not gw.state.cluster.view().replicas[0].healthy)
        engines[0].low_priority_first = True
        await engines[0].set_faults(FaultConfig())
        await _until(lambda: facts.reads > reads)
        assert facts.runs_higher_first(e0) is False
        # No re-read while it stays in service.
        reads = facts.reads
        await asyncio.sleep(0.5)
        assert facts.reads == reads


async def test_capacity_from_server_info_when_the_engine_serves_no_metrics() -> None:
    async with (
        sim_engines(1, "instant", flavor="sglang", metrics_enabled=False) as engines,
        gateway(engines, scrape={"interval_s": 0.1}) as gw,
    ):
        want = PROFILES["instant"].kv_capacity_tokens

        def capacity() -> int | None:
            return gw.state.cluster.view().replicas[0].kv_capacity_tokens

        await _until(lambda: capacity() == want)


async def test_a_replica_that_describes_itself_neither_way_keeps_the_defaults() -> None:
    service = EngineFactsService(lambda: {ReplicaId("x"): "http://127.0.0.1:9"}, retry_s=0.05)
    await service.start()
    try:
        await asyncio.sleep(0.3)
        assert service.get(ReplicaId("x")) is None
        assert service.runs_higher_first(ReplicaId("x")) is None
        assert service.capacity(ReplicaId("x")) is None
    finally:
        await service.stop()
