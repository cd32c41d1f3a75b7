"""What a running engine (and the gateway) expose, read into plain snapshots.

Per engine: `/metrics` (parsed by the scraper's own dialect readers, plus the few extra
series a diagnosis needs: vLLM's `cache_config_info` labels, preemption and token
counters), `/v1/models` for `max_model_len`, and SGLang's `/server_info` (its server args).
Per gateway: its `/metrics` view of each replica (scrape age, requests in flight, routing
decisions by reason).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from gateway.scrape.adapters import (
    EngineReading,
    MetricsFormatError,
    SampleIndex,
    index_samples,
    read_engine,
)
from gateway.scrape.config import EngineKind

_COUNTERS = {
    "preemptions": ("vllm:num_preemptions_total", "sglang:num_retracted_requests_total"),
    "prompt_tokens": ("vllm:prompt_tokens_total", "sglang:prompt_tokens_total"),
    "generation_tokens": ("vllm:generation_tokens_total", "sglang:generation_tokens_total"),
    "requests": ("vllm:request_success_total", "sglang:num_requests_total"),
}


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    url: str
    at: float
    error: str | None = None
    reading: EngineReading | None = None
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    counters: Mapping[str, float] = field(default_factory=dict)
    # SGLang server args, when `/server_info` answers: max_running_requests, ...
    server_args: Mapping[str, Any] = field(default_factory=dict)
    # `/health`'s status: vLLM's API server answers /metrics after its engine core died,
    # and says so only here (503).
    health_status: int | None = None

    @property
    def kind(self) -> EngineKind | None:
        return self.reading.kind if self.reading is not None else None

    @property
    def kv_capacity_tokens(self) -> int | None:
        return self.reading.kv_capacity_tokens if self.reading is not None else None


@dataclass(frozen=True, slots=True)
class GatewaySnapshot:
    url: str
    at: float
    error: str | None = None
    scrape_age_s: Mapping[str, float] = field(default_factory=dict)
    # Per replica, the age up to which its load counts (longer for a quiet replica);
    # absent from a gateway of an earlier version.
    scrape_fresh_for_s: Mapping[str, float] = field(default_factory=dict)
    in_flight: Mapping[str, float] = field(default_factory=dict)
    decisions: Mapping[str, float] = field(default_factory=dict)  # by reason
    scrape_errors: Mapping[str, float] = field(default_factory=dict)  # by replica
    # What the gateway saw of each replica (totals since it started): requests answered
    # (by replica, then status), attempts given up on (kvgate_upstream_failures_total).
    requests: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    upstream_failures: Mapping[str, float] = field(default_factory=dict)
    healthy: Mapping[str, float] = field(default_factory=dict)
    # Series other gateway versions may lack (then empty): outlier ejection and the
    # fallback to the gateway's own counts when a replica gives no engine load.
    ejected: Mapping[str, float] = field(default_factory=dict)
    ejections: Mapping[str, float] = field(default_factory=dict)  # by "replica/reason"
    load_missing: Mapping[str, float] = field(default_factory=dict)
    # Admission: requests waiting now per class, 429s so far by "class/reason".
    queued: Mapping[str, float] = field(default_factory=dict)
    rejected: Mapping[str, float] = field(default_factory=dict)


def _first(index: SampleIndex, names: Sequence[str]) -> float | None:
    for name in names:
        series = index.get(name)
        if series:
            return sum(v for _, v in series)
    return None


def _label_int(labels: Mapping[str, str], key: str) -> int | None:
    try:
        return int(float(labels[key]))
    except (KeyError, ValueError):
        return None  # `num_gpu_blocks` is "None" until the engine profiled its memory


def _cache_config(index: SampleIndex) -> tuple[int | None, int | None, float | None]:
    """(blocks over all DP ranks, block size, gpu_memory_utilization) from cache_config_info."""
    series = index.get("vllm:cache_config_info")
    if not series:
        return None, None, None
    blocks = [b for labels, _ in series if (b := _label_int(labels, "num_gpu_blocks")) is not None]
    labels = series[0][0]
    try:
        util: float | None = float(labels["gpu_memory_utilization"])
    except (KeyError, ValueError):
        util = None
    return sum(blocks) or None, _label_int(labels, "block_size"), util


def parse_engine(url: str, text: str, at: float) -> EngineSnapshot:
    """One `/metrics` exposition, read as the scraper reads it plus the doctor's extras."""
    reading = read_engine(text)
    index = index_samples(text)
    blocks, size, util = _cache_config(index)
    counters = {k: v for k, names in _COUNTERS.items() if (v := _first(index, names)) is not None}
    return EngineSnapshot(
        url,
        at,
        reading=reading,
        num_gpu_blocks=blocks,
        block_size=size,
        gpu_memory_utilization=util,
        counters=counters,
    )


def _json(response: httpx.Response) -> Any:
    if response.status_code != 200:
        return None
    try:
        return orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return None


async def probe_engine(client: httpx.AsyncClient, url: str) -> EngineSnapshot:
    base = url.rstrip("/")
    at = time.monotonic()
    try:
        metrics = await client.get(base + "/metrics")
        if metrics.status_code != 200:
            return EngineSnapshot(url, at, error=f"/metrics answered {metrics.status_code}")
        snap = parse_engine(url, metrics.text, at)
        health = (await client.get(base + "/health")).status_code
        models = _json(await client.get(base + "/v1/models"))
        max_len = None
        if isinstance(models, dict) and models.get("data"):
            value = models["data"][0].get("max_model_len")
            max_len = int(value) if isinstance(value, int | float) else None
        args: dict[str, Any] = {}
        if snap.kind is EngineKind.SGLANG:
            info = _json(await client.get(base + "/server_info"))
            if info is None:
                info = _json(await client.get(base + "/get_server_info"))
            if isinstance(info, dict):
                args = info
                if max_len is None and isinstance(info.get("context_length"), int):
                    max_len = info["context_length"]
    except httpx.TimeoutException:
        return EngineSnapshot(url, at, error="timed out")
    except httpx.HTTPError as exc:
        return EngineSnapshot(url, at, error=f"unreachable ({type(exc).__name__})")
    except MetricsFormatError as exc:
        return EngineSnapshot(url, at, error=exc.message)
    return EngineSnapshot(
        url,
        at,
        reading=snap.reading,
        num_gpu_blocks=snap.num_gpu_blocks,
        block_size=snap.block_size,
        gpu_memory_utilization=snap.gpu_memory_utilization,
        max_model_len=max_len,
        counters=snap.counters,
        server_args=args,
        health_status=health,
    )


def parse_gateway(url: str, text: str, at: float) -> GatewaySnapshot:
    try:
        index = index_samples(text)
    except MetricsFormatError as exc:
        return GatewaySnapshot(url, at, error=exc.message)

    def by(name: str, *label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for labels, value in index.get(name, ()):
            key = "/".join(labels.get(x, "") for x in label)
            out[key] = out.get(key, 0.0) + value
        return out

    requests: dict[str, dict[str, float]] = {}
    for labels, value in index.get("kvgate_requests_total", ()):
        per = requests.setdefault(labels.get("replica", ""), {})
        status = labels.get("status", "")
        per[status] = per.get(status, 0.0) + value

    return GatewaySnapshot(
        url,
        at,
        scrape_age_s=by("kvgate_scrape_age_seconds", "replica"),
        scrape_fresh_for_s=by("kvgate_scrape_fresh_for_seconds", "replica"),
        in_flight=by("kvgate_in_flight", "replica"),
        decisions=by("kvgate_routing_decisions_total", "reason"),
        scrape_errors=by("kvgate_scrape_errors_total", "replica"),
        requests=requests,
        upstream_failures=by("kvgate_upstream_failures_total", "replica"),
        healthy=by("kvgate_replica_healthy", "replica"),
        ejected=by("kvgate_replica_ejected", "replica"),
        ejections=by("kvgate_replica_ejections_total", "replica", "reason"),
        load_missing=by("kvgate_replica_engine_load_missing", "replica"),
        queued=by("kvgate_admission_queue_depth", "priority_class"),
        rejected=by("kvgate_admission_rejected_total", "priority_class", "reason"),
    )


async def probe_gateway(client: httpx.AsyncClient, url: str) -> GatewaySnapshot:
    at = time.monotonic()
    try:
        response = await client.get(url.rstrip("/") + "/metrics")
    except httpx.HTTPError as exc:
        return GatewaySnapshot(url, at, error=f"unreachable ({type(exc).__name__})")
    if response.status_code != 200:
        return GatewaySnapshot(url, at, error=f"/metrics answered {response.status_code}")
    return parse_gateway(url, response.text, at)
