"""The simulated engine's /metrics against the recorded engines (tests/fixtures/engines) and
read by the gateway's own parser (gateway.scrape.adapters): every family the twin exposes
under an engine's prefix is one the engine has, with the same kind and no label the engine
lacks, and what the gateway reads from it is what the engine model holds at that moment."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families
from sim_helpers import eventually, test_profile

from gateway.scrape.adapters import _READ_SAMPLES, CounterState, read_engine
from gateway.scrape.config import EngineKind
from gateway.sim.cluster import SimCluster
from gateway.sim.metrics import SimMetrics
from gateway.sim.server import SimEngine
from tests.kvevents.engine_fixtures import SGLANG, VLLM, load

pytestmark = pytest.mark.asyncio(loop_scope="module")

FIXTURE = {"vllm": VLLM, "sglang": SGLANG}
# Labels the engine adds at run time to its info gauges (the fixture records the config
# object's fields): vLLM puts its engine index on cache_config_info.
RUNTIME_LABELS = {"vllm:cache_config_info": {"engine"}}


def recorded(flavor: str) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in load(FIXTURE[flavor], "metrics.json")["series"]}


def families(text: str, prefix: str) -> dict[str, tuple[str, set[str]]]:
    """Family name -> (type, label names) of the exposition, `_created` gauges left out."""
    out: dict[str, tuple[str, set[str]]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(prefix) or family.name.endswith("_created"):
            continue
        labels: set[str] = set()
        for sample in family.samples:
            labels |= set(sample.labels) - {"le", "quantile"}
        out[family.name] = (family.type, labels)
    return out


def real_entry(series: dict[str, dict[str, Any]], name: str) -> dict[str, Any] | None:
    # A counter family `x` is exposed as `x_total`: the recording names either.
    return (
        series.get(name) or series.get(name + "_total") or series.get(name.removesuffix("_total"))
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines() -> AsyncIterator[dict[str, SimEngine]]:
    async with (
        SimCluster(1, test_profile(), flavor="vllm") as vllm,
        SimCluster(1, test_profile(), flavor="sglang") as sglang,
        httpx.AsyncClient(timeout=10) as http,
    ):
        out = {"vllm": vllm.engines[0], "sglang": sglang.engines[0]}
        for engine in out.values():  # some traffic, so every series has a sample
            for _ in range(2):
                body = {"prompt": "the sea is wide " * 20, "max_tokens": 3}
                assert (await http.post(engine.url + "/v1/completions", json=body)).is_success
        yield out


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
async def test_every_engine_family_the_twin_exposes_is_the_engines_own(
    engines: dict[str, SimEngine], flavor: str
) -> None:
    async with httpx.AsyncClient() as http:
        reply = await http.get(engines[flavor].url + "/metrics")
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    sim = families(reply.text, flavor + ":")
    real = recorded(flavor)
    assert len(sim) >= 10
    for name, (kind, labels) in sim.items():
        entry = real_entry(real, name)
        assert entry is not None, f"{name}: the engine has no such series"
        assert entry["kind"].lower() == kind, name
        known = set(entry.get("labels") or ()) | RUNTIME_LABELS.get(name, set())
        if entry.get("labels"):  # a literal label list was recorded
            assert labels <= known, (name, labels - known)


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
async def test_the_twin_exposes_every_series_the_gateway_reads_that_the_engine_has(
    engines: dict[str, SimEngine], flavor: str
) -> None:
    real = recorded(flavor)
    wanted = {n for n in _READ_SAMPLES if n.startswith(flavor + ":") and real_entry(real, n)}
    assert wanted, "the gateway reads nothing the engine exposes?"
    text = engines[flavor].metrics.render().decode()
    exposed = {
        sample.name for family in text_string_to_metric_families(text) for sample in family.samples
    }
    assert wanted <= exposed, wanted - exposed


@pytest.mark.parametrize(
    ("flavor", "kind"), [("vllm", EngineKind.VLLM), ("sglang", EngineKind.SGLANG)]
)
async def test_what_the_gateway_reads_is_what_the_engine_holds(
    engines: dict[str, SimEngine], flavor: str, kind: EngineKind
) -> None:
    engine = engines[flavor]
    model = engine.model
    async with httpx.AsyncClient(timeout=30) as http:
        body = {"prompt": "x" * 600, "max_tokens": 60, "ignore_eos": True}
        tasks = [
            asyncio.create_task(http.post(engine.url + "/v1/completions", json=body))
            for _ in range(3)
        ]
        await eventually(lambda: model.num_running >= 1 and model.kv_usage > 0)
        # No await between the engine's state and its exposition: they must agree exactly.
        reading = read_engine(engine.metrics.render().decode())
        running, waiting, usage = model.num_running, model.num_waiting, model.kv_usage
        await asyncio.gather(*tasks)
    assert reading.kind is kind
    assert (reading.running, reading.waiting) == (running, waiting)
    assert reading.kv_usage == pytest.approx(usage)
    assert reading.kv_capacity_tokens == model.kv.num_blocks * model.kv.block_size
    idle = read_engine(engine.metrics.render().decode(), kind)
    assert (idle.running, idle.waiting, idle.kv_usage) == (0, 0, 0)
    stats = model.stats
    assert idle.prefix_hit_rate == pytest.approx(stats.prefix_hits / stats.prefix_queries)


async def test_vllm_counters_give_the_recent_hit_rate_across_scrapes(
    engines: dict[str, SimEngine],
) -> None:
    engine = engines["vllm"]
    first = read_engine(engine.metrics.render().decode())
    assert first.counters is not None
    async with httpx.AsyncClient() as http:
        body = {"prompt": "the sea is wide " * 20, "max_tokens": 1}  # all but a block cached
        assert (await http.post(engine.url + "/v1/completions", json=body)).is_success
    second = read_engine(engine.metrics.render().decode(), previous=first.counters)
    assert second.counters is not None
    hits = second.counters.hits - first.counters.hits
    queries = second.counters.queries - first.counters.queries
    assert queries == engine.request_log[-1].prompt_tokens
    assert hits == engine.request_log[-1].cached_tokens > 0
    assert second.prefix_hit_rate == pytest.approx(hits / queries)
    # Counters that went backwards (a restarted engine) are read as the new totals.
    restarted = read_engine(engine.metrics.render().decode(), previous=CounterState(1e9, 1e9, 0.5))
    assert restarted.prefix_hit_rate == pytest.approx(
        second.counters.hits / second.counters.queries
    )


async def test_an_unknown_flavor_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown metrics flavor"):
        SimMetrics(None, "m", "tgi")  # type: ignore[arg-type]


async def test_metrics_off_is_a_404_but_still_counted(engines: dict[str, SimEngine]) -> None:
    engine = engines["sglang"]
    before = engine.metrics_requests
    engine.metrics_enabled = False
    try:
        async with httpx.AsyncClient() as http:
            reply = await http.get(engine.url + "/metrics")
    finally:
        engine.metrics_enabled = True
    assert reply.status_code == 404 and reply.json()["error"]["code"] == 404
    assert engine.metrics_requests == before + 1
