"""What `kvgate doctor` reads from an engine, held to the series vLLM 0.33 and SGLang 0.5.23
register (tests/fixtures/engines, recorded from their released wheels), and served over real
HTTP by a stand-in engine that answers exactly what the test sets: odd statuses, bodies that
are not JSON, SGLang's older /get_server_info, an engine that stops answering."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from gateway.doctor.checks import diagnose
from gateway.doctor.engine import check_engine
from gateway.doctor.findings import Hints
from gateway.doctor.probe import _COUNTERS, parse_engine, probe_engine, probe_gateway
from gateway.scrape.config import EngineKind
from gateway.serving import start_server

ENGINES = Path(__file__).resolve().parents[1] / "fixtures" / "engines"


def recorded(engine: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((ENGINES / engine / "metrics.json").read_text())
    return data


def series(engine: str) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in recorded(engine)["series"]}


def exposed(name: str, kind: str) -> str:
    """prometheus_client's exposition name: a counter gains `_total`."""
    return name if kind.lower() != "counter" or name.endswith("_total") else name + "_total"


def test_the_counters_the_doctor_reads_are_the_engines_own() -> None:
    names = {
        engine: {exposed(n, s["kind"]) for n, s in series(engine).items()}
        for engine in ("vllm-0.33.0", "sglang-0.5.23")
    }
    for key, (vllm, sglang) in _COUNTERS.items():
        assert vllm in names["vllm-0.33.0"], key
        assert sglang in names["sglang-0.5.23"], key
    # vLLM's cache_config_info carries what the KV arithmetic needs, as labels.
    labels = series("vllm-0.33.0")["vllm:cache_config_info"]["labels"]
    assert {"num_gpu_blocks", "block_size", "gpu_memory_utilization"} <= set(labels)


def vllm_exposition(
    running: float,
    waiting: float,
    counters: Mapping[str, float],
    blocks: tuple[str, ...] = ("2000", "2000"),
    usage: float = 0.5,
) -> str:
    """An exposition with vLLM 0.33's names and label sets, two DP ranks (engine 0 and 1)."""
    known = series("vllm-0.33.0")
    lines = []
    for rank, nblocks in enumerate(blocks):
        base = f'model_name="m",engine="{rank}"'
        for name, value in (
            ("vllm:num_requests_running", running / len(blocks)),
            ("vllm:num_requests_waiting", waiting / len(blocks)),
            ("vllm:kv_cache_usage_perc", usage),
        ):
            assert known[name]["labels"] == ["model_name", "engine"]
            lines.append(f"{name}{{{base}}} {value}")
        for name, value in counters.items():
            assert name.removesuffix("_total") in known
            lines.append(f"{name}{{{base}}} {value / len(blocks)}")
        info = {label: "" for label in known["vllm:cache_config_info"]["labels"]}
        info.update(
            block_size="16", gpu_memory_utilization="0.9", num_gpu_blocks=nblocks, engine=str(rank)
        )
        shown = ",".join(f'{k}="{v}"' for k, v in info.items())
        lines.append(f"vllm:cache_config_info{{{shown}}} 1.0")
    return "\n".join(lines) + "\n"


TOKENS = {"vllm:prompt_tokens_total": 5000.0, "vllm:generation_tokens_total": 800.0}


def test_parse_sums_blocks_over_data_parallel_ranks() -> None:
    snap = parse_engine("http://e", vllm_exposition(4, 2, TOKENS), 0.0)
    assert snap.kind is EngineKind.VLLM
    assert (snap.num_gpu_blocks, snap.block_size, snap.gpu_memory_utilization) == (4000, 16, 0.9)
    assert snap.counters == {"prompt_tokens": 5000.0, "generation_tokens": 800.0}
    assert snap.reading is not None and (snap.reading.running, snap.reading.waiting) == (4, 2)
    # Before the engine profiled its memory, vLLM shows num_gpu_blocks "None".
    early = parse_engine("http://e", vllm_exposition(0, 0, {}, blocks=("None", "None")), 0.0)
    assert early.num_gpu_blocks is None and early.block_size == 16


def test_metrics_that_do_not_move_while_requests_run_are_stale() -> None:
    frozen = [parse_engine("http://e", vllm_exposition(3, 0, TOKENS), t) for t in (0.0, 5.0)]
    (f,) = [f for f in check_engine("http://e", frozen, Hints()) if f.code == "stale_metrics"]
    assert f.severity == "warning" and f.replica == "http://e"
    assert f.evidence == (
        "3 running, but the prompt and generation token counters did not change in 5.0 s",
    )
    moving = {**TOKENS, "vllm:generation_tokens_total": 900.0}
    moved = [frozen[0], parse_engine("http://e", vllm_exposition(3, 0, moving), 5.0)]
    assert "stale_metrics" not in {f.code for f in check_engine("http://e", moved, Hints())}
    idle = [parse_engine("http://e", vllm_exposition(0, 0, TOKENS), t) for t in (0.0, 5.0)]
    assert "stale_metrics" not in {f.code for f in check_engine("http://e", idle, Hints())}


def test_preemptions_after_a_restart_count_from_zero() -> None:
    before = {**TOKENS, "vllm:num_preemptions_total": 100.0}
    after = {
        "vllm:prompt_tokens_total": 10.0,
        "vllm:generation_tokens_total": 1.0,
        "vllm:num_preemptions_total": 6.0,
    }
    samples = [
        parse_engine("http://e", vllm_exposition(8, 0, before, usage=0.95), 0.0),
        parse_engine("http://e", vllm_exposition(8, 0, after, usage=0.95), 2.0),
    ]
    (f,) = [f for f in check_engine("http://e", samples, Hints()) if f.code == "preemptions"]
    # The counter fell: the engine restarted, so all 6 are new, within the window.
    assert f.severe and f.evidence[0] == "preemptions: 6 since start, 6 in the last 2.0 s"
    assert "64,000 KV tokens / 8 running = 8,000 tokens per running request" in f.evidence[2]
    assert "max_num_seqs ~6 (now 256, vLLM default; pass --max-num-seqs)" in f.suggestion


class StandIn:
    """An engine on loopback whose every answer the test sets."""

    def __init__(self) -> None:
        self.metrics: tuple[int, str] = (200, vllm_exposition(1, 0, TOKENS))
        self.models: Response = JSONResponse({"data": [{"id": "m", "max_model_len": 8192}]})
        self.health = 200
        self.server_info: Response = Response(status_code=404)
        self.get_server_info: Response = Response(status_code=404)
        self.delay = 0.0
        self.paths: list[str] = []

    async def _metrics(self, request: Request) -> Response:
        self.paths.append("/metrics")
        await asyncio.sleep(self.delay)
        status, text = self.metrics
        return PlainTextResponse(text, status_code=status)

    async def _other(self, request: Request) -> Response:
        self.paths.append(request.url.path)
        return {
            "/v1/models": self.models,
            "/health": Response(status_code=self.health),
            "/server_info": self.server_info,
            "/get_server_info": self.get_server_info,
        }[request.url.path]

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/metrics", self._metrics),
                *(
                    Route(p, self._other)
                    for p in ("/v1/models", "/health", "/server_info", "/get_server_info")
                ),
            ]
        )


@contextlib.asynccontextmanager
async def stand_in() -> AsyncIterator[tuple[StandIn, str]]:
    engine = StandIn()
    server = await start_server(engine.app())
    try:
        yield engine, server.url
    finally:
        await server.stop()


SGLANG = (
    'sglang:num_running_reqs{model_name="m",engine_type="unified",tp_rank="0",pp_rank="0",'
    'moe_ep_rank="0"} 2\n'
    'sglang:num_queue_reqs{model_name="m",engine_type="unified",tp_rank="0",pp_rank="0",'
    'moe_ep_rank="0"} 0\n'
    'sglang:max_total_num_tokens{model_name="m",engine_type="unified",tp_rank="0",pp_rank="0",'
    'moe_ep_rank="0"} 3000\n'
)


async def test_what_a_vllm_engine_answers_over_http() -> None:
    async with stand_in() as (engine, url), httpx.AsyncClient(timeout=2.0) as client:
        snap = await probe_engine(client, url)
        assert snap.error is None and snap.max_model_len == 8192 and snap.health_status == 200
        assert engine.paths == ["/metrics", "/health", "/v1/models"]  # no SGLang paths
        # /v1/models that fails or is not JSON: max_model_len unknown, the rest still read.
        for models in (Response(status_code=500), PlainTextResponse("<html>")):
            engine.models = models
            snap = await probe_engine(client, url)
            assert snap.error is None and snap.max_model_len is None
            assert snap.reading is not None
        engine.metrics = (500, "")
        assert (await probe_engine(client, url)).error == "/metrics answered 500"
        engine.metrics = (200, "vllm:num_requests_running{ 1\n")
        broken = await probe_engine(client, url)
        assert broken.error is not None and broken.reading is None
        d = diagnose({url: [broken]}, None, Hints())
        assert [f.code for f in d.findings] == ["unreachable"] and d.severe


async def test_an_sglang_engine_without_server_info_falls_back_to_the_old_path() -> None:
    async with stand_in() as (engine, url), httpx.AsyncClient(timeout=2.0) as client:
        engine.metrics = (200, SGLANG)
        engine.models = JSONResponse({"data": [{"id": "m"}]})
        engine.get_server_info = JSONResponse(
            {"context_length": 4096, "max_running_requests": 48, "chunked_prefill_size": 2048}
        )
        snap = await probe_engine(client, url)
        assert snap.kind is EngineKind.SGLANG and snap.kv_capacity_tokens == 3000
        assert engine.paths[-2:] == ["/server_info", "/get_server_info"]
        # The context length comes from server_info when /v1/models has none.
        assert snap.max_model_len == 4096 and snap.server_args["max_running_requests"] == 48
        d = diagnose({url: [snap]}, None, Hints())
        (starved,) = [f for f in d.findings if f.code == "kv_starved"]
        assert "max_num_seqs 48 (server_info)" in starved.evidence[2]
        (mnbt,) = [f for f in d.findings if f.code == "max_num_batched_tokens_high"]
        assert "2,048 (server_info chunked_prefill_size) vs KV capacity 3,000" in mnbt.evidence[0]
        # Neither path answering: no server args, nothing made up.
        engine.get_server_info = Response(status_code=404)
        engine.models = JSONResponse({"data": [{"id": "m", "max_model_len": 2048}]})
        bare = await probe_engine(client, url)
        assert bare.server_args == {} and bare.max_model_len == 2048


async def test_an_engine_slower_than_the_timeout() -> None:
    async with stand_in() as (engine, url), httpx.AsyncClient(timeout=0.1) as client:
        engine.delay = 0.4
        snap = await probe_engine(client, url)
    assert snap.error == "timed out" and snap.reading is None


async def test_a_gateway_url_that_is_not_a_gateway() -> None:
    async with stand_in() as (engine, url), httpx.AsyncClient(timeout=2.0) as client:
        engine.metrics = (503, "")
        view = await probe_gateway(client, url)
        assert view.error == "/metrics answered 503"
        d = diagnose({}, view, Hints())
        assert [(f.code, f.severity) for f in d.findings] == [("gateway_unreachable", "warning")]
        assert f"GET {url}/metrics: /metrics answered 503" in d.findings[0].evidence
        engine.metrics = (200, "kvgate_in_flight{replica= 1\n")
        garbled = await probe_gateway(client, url)
        assert garbled.error is not None and garbled.scrape_age_s == {}


@pytest.mark.parametrize("status", [500, 503])
def test_any_non_200_health_is_named(status: int) -> None:
    snap = parse_engine("http://e", vllm_exposition(1, 0, TOKENS), 0.0)
    sick = replace(snap, health_status=status)
    (f,) = [f for f in check_engine("http://e", [sick], Hints()) if f.code == "engine_unhealthy"]
    assert f.evidence[0] == f"GET http://e/health: {status}"
    assert check_engine("http://e", [replace(snap, health_status=None)], Hints()) == []
