"""Prometheus exposition of one simulated engine, under vLLM's or SGLang's names.

Each engine owns a `CollectorRegistry` (never the global one). Gauges and counters are read
from the engine model at scrape time, so serving a request costs nothing here; latency
histograms are observed once per finished request.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise
from typing import TYPE_CHECKING, Literal

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from gateway.sim.engine import EngineModel, RequestHandle

Flavor = Literal["vllm", "sglang"]

VLLM_TTFT_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
VLLM_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
VLLM_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
SGLANG_TTFT_BUCKETS = (
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1.0,
    2.0,
    4.0,
    6.0,
    8.0,
    10.0,
    20.0,
    40.0,
    60.0,
    80.0,
    100.0,
    200.0,
    400.0,
)
SGLANG_ITL_BUCKETS = (
    0.002,
    0.004,
    0.006,
    0.008,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.035,
    0.04,
    0.06,
    0.08,
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1.0,
    2.0,
    4.0,
    6.0,
    8.0,
)
SGLANG_E2E_BUCKETS = (
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1.0,
    2.0,
    4.0,
    6.0,
    8.0,
    10.0,
    20.0,
    40.0,
    60.0,
    80.0,
    100.0,
    200.0,
    400.0,
    600.0,
    1200.0,
    1800.0,
    2400.0,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SimMetrics:
    """Metrics of one engine. `observe_finished` is the engine's `on_finished` hook."""

    def __init__(self, model: EngineModel, model_name: str, flavor: Flavor = "vllm") -> None:
        if flavor not in ("vllm", "sglang"):
            raise ValueError(f"unknown metrics flavor {flavor!r}")
        self.model = model
        self.model_name = model_name
        self.flavor: Flavor = flavor
        self.client_disconnects = 0
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_StateCollector(self))
        if flavor == "vllm":
            labels = {"model_name": model_name, "engine": "0"}
            names = (
                "vllm:time_to_first_token_seconds",
                "vllm:inter_token_latency_seconds",
                "vllm:e2e_request_latency_seconds",
            )
            buckets: tuple[tuple[float, ...], ...] = (
                VLLM_TTFT_BUCKETS,
                VLLM_ITL_BUCKETS,
                VLLM_E2E_BUCKETS,
            )
        else:
            labels = {"model_name": model_name}
            names = (
                "sglang:time_to_first_token_seconds",
                "sglang:inter_token_latency_seconds",
                "sglang:e2e_request_latency_seconds",
            )
            buckets = (SGLANG_TTFT_BUCKETS, SGLANG_ITL_BUCKETS, SGLANG_E2E_BUCKETS)
        docs = (
            "Histogram of time to first token in seconds.",
            "Histogram of inter-token latency in seconds.",
            "Histogram of end to end request latency in seconds.",
        )
        hists = [
            Histogram(n, d, list(labels), buckets=b, registry=self.registry).labels(**labels)
            for n, d, b in zip(names, docs, buckets, strict=True)
        ]
        self._ttft, self._itl, self._e2e = hists

    def observe_finished(self, handle: RequestHandle) -> None:
        """Latencies in simulated seconds, from arrival (as vLLM measures them)."""
        if handle.first_token_time is not None:
            self._ttft.observe(handle.first_token_time - handle.arrival)
            times = handle.token_times
            observe = self._itl.observe
            for a, b in pairwise(times):
                observe(b - a)
        if handle.finish_time is not None and handle.finish_reason != "abort":
            self._e2e.observe(handle.finish_time - handle.arrival)

    def render(self, names: list[str] | None = None) -> bytes:
        """The exposition; with `names` (a `name[]` query to prometheus-client's app), only
        those samples, as each engine's registry answers it: vLLM's (one API server) is the
        global registry, whose collectors are registered by name, so it selects them;
        SGLang collects in multiprocess mode, a collector registered without names, which a
        restricted registry leaves out: it answers with nothing."""
        if names is None:
            return generate_latest(self.registry)
        if self.flavor == "sglang":
            return b""
        return generate_latest(self.registry.restricted_registry(names))


class _StateCollector(Collector):
    def __init__(self, owner: SimMetrics) -> None:
        self._o = owner

    def collect(self) -> Iterator[Metric]:
        if self._o.flavor == "vllm":
            yield from self._vllm()
        else:
            yield from self._sglang()
        yield from self._sim_extras()

    def _vllm(self) -> Iterator[Metric]:
        m, o = self._o.model, self._o
        keys = ["model_name", "engine"]
        vals = [o.model_name, "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=keys)
            g.add_metric(vals, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=keys)
            c.add_metric(vals, value)
            return c

        s = m.stats
        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            m.num_running,
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            m.num_waiting,
        )
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m.kv_usage
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_hits,
        )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            s.preemptions,
        )
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=["model_name", "engine", "finished_reason"],
        )
        for reason, n in sorted(s.finished.items()):
            success.add_metric([o.model_name, "0", reason], n)
        yield success
        p = m.profile
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "gpu_memory_utilization",
                "num_gpu_blocks",
                "engine",
            ],
        )
        info.add_metric(
            [
                str(p.block_size),
                "auto",
                "True",
                f"{p.gpu_memory_utilization:g}",
                str(p.num_gpu_blocks),
                "0",
            ],
            1.0,
        )
        yield info

    def _sglang(self) -> Iterator[Metric]:
        m, o = self._o.model, self._o
        sched_keys = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"]
        sched_vals = [o.model_name, "unified", "0", "0", "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=sched_keys)
            g.add_metric(sched_vals, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([o.model_name], value)
            return c

        s = m.stats
        p = m.profile
        used_tokens = m.kv.blocks_in_use * p.block_size
        hit_rate = s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0
        yield gauge("sglang:num_running_reqs", "The number of running requests.", m.num_running)
        yield gauge(
            "sglang:num_queue_reqs", "The number of requests in the waiting queue.", m.num_waiting
        )
        yield gauge("sglang:token_usage", "The token usage.", m.kv_usage)
        yield gauge("sglang:num_used_tokens", "The number of used tokens.", used_tokens)
        yield gauge(
            "sglang:max_total_num_tokens",
            "Maximum total number of tokens in the KV cache pool.",
            p.kv_capacity_tokens,
        )
        yield gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", hit_rate)
        yield counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens
        )
        yield counter(
            "sglang:generation_tokens",
            "Number of generation tokens processed.",
            s.generation_tokens,
        )
        yield counter("sglang:cached_tokens", "Number of cached prompt tokens.", s.prefix_hits)
        yield counter(
            "sglang:num_retracted_requests", "Number of retracted requests.", s.preemptions
        )
        yield counter(
            "sglang:num_aborted_requests", "Number of requests aborted.", s.finished.get("abort", 0)
        )
        yield counter(
            "sglang:num_requests", "Number of requests processed.", sum(s.finished.values())
        )

    def _sim_extras(self) -> Iterator[Metric]:
        m, o = self._o.model, self._o
        moved = CounterMetricFamily(
            "kvgate_sim_kv_transfer_bytes",
            "KV cache bytes moved between PD engines (simulated).",
            labels=["model_name", "direction"],
        )
        moved.add_metric([o.model_name, "tx"], m.stats.kv_tx_bytes)
        moved.add_metric([o.model_name, "rx"], m.stats.kv_rx_bytes)
        yield moved
        disc = CounterMetricFamily(
            "kvgate_sim_client_disconnects",
            "Requests aborted because the client went away.",
            labels=["model_name"],
        )
        disc.add_metric([o.model_name], o.client_disconnects)
        yield disc
        ev = CounterMetricFamily(
            "kvgate_sim_prefix_cache_evictions",
            "Cached KV blocks evicted to make room.",
            labels=["model_name"],
        )
        ev.add_metric([o.model_name], m.kv.evictions)
        yield ev
