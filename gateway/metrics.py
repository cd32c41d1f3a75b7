"""The gateway's own Prometheus series, on a per-app `CollectorRegistry`.

Features register their own series on `GatewayMetrics.registry`. Per-replica gauges
(in-flight, health) are read from the live cluster at scrape time by a collector, so the
request path never touches a gauge for them.

| series | type | labels |
|---|---|---|
| kvgate_requests_total | counter | endpoint, replica, status |
| kvgate_errors_total | counter | code |
| kvgate_request_duration_seconds | histogram | endpoint, stream |
| kvgate_ttfb_seconds | histogram | endpoint, stream |
| kvgate_retries_total | counter | reason |
| kvgate_routing_decisions_total | counter | policy, reason |
| kvgate_client_disconnects_total | counter | phase |
| kvgate_upstream_failures_total | counter | replica, kind |
| kvgate_in_flight | gauge | replica |
| kvgate_replica_healthy | gauge | replica |
| kvgate_replica_ejected | gauge | replica |
| kvgate_replica_ejections_total | counter | replica, reason |
| kvgate_lineage_blocks | gauge | |
| kvgate_lineage_capacity_blocks | gauge | |
| kvgate_lineages | gauge | |
| kvgate_lineage_tail_bytes | gauge | |
| kvgate_time_to_first_token_seconds | histogram | model, replica |
| kvgate_inter_token_latency_seconds | histogram | model, replica |
| kvgate_time_per_output_token_seconds | histogram | model, replica |
| kvgate_e2e_request_latency_seconds | histogram | model, replica |
| kvgate_prompt_tokens_total | counter | model, replica, pool |
| kvgate_cached_prompt_tokens_total | counter | model, replica, pool |
| kvgate_generation_tokens_total | counter | model, replica, pool |
| kvgate_replica_cost_total | counter | replica, pool |
| kvgate_cache_predicted_tokens_total | counter | replica, policy |
| kvgate_cache_best_tokens_total | counter | replica, policy |
| kvgate_cache_achieved_tokens_total | counter | replica, policy |
| kvgate_cache_prediction_error_tokens | histogram | replica, policy |

docs/observability.md explains each series (what it measures, from when to when).

`kvgate_errors_total` counts only errors the gateway made itself (not relayed engine
statuses); `phase` of a disconnect is `before_response` or `mid_stream`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import ClassVar

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from gateway.cluster import Cluster
from gateway.health import HealthMonitor
from gateway.lineage import LineageIndex
from gateway.metric_merge import MergeMode
from gateway.token_timing import StreamTimer

# Latencies of LLM calls span milliseconds (cached, short) to minutes (100K-token prefill).
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
)
# Signed, in tokens: negative when the engine held less than predicted (an eviction, a
# stale index), positive when more (a prefix the index did not know).
CACHE_ERROR_BUCKETS = tuple(
    float(b) for b in (-65536, -16384, -4096, -1024, -256, -1, 0, 256, 1024, 4096, 16384, 65536)
)
# vLLM's own buckets for per-token latency span 10 ms to 80 s; a gateway in front of a fast
# engine needs the millisecond end as well.
TOKEN_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
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
    10.0,
)
# Label of a model no replica announced: a client cannot mint label values.
OTHER_MODEL = "other"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class GatewayRegistry(CollectorRegistry):
    """A registry that knows which of its collectors compute their series at scrape time.

    prometheus-client's own metric objects (Counter, Gauge, Histogram) keep their values in
    files shared by the workers of `kvgate serve --workers N`; the other collectors read a
    worker's live state when collected, so gateway.workers copies their output between
    workers. Such a collector may say how its gauges merge across workers with a
    `merge_modes` mapping (gateway.workers.snapshot.MergesAcrossWorkers).
    """

    def __init__(self) -> None:
        super().__init__(auto_describe=True)
        self._live: list[Collector] = []

    def register(self, collector: Collector) -> None:
        super().register(collector)
        if not isinstance(collector, MetricWrapperBase):
            self._live.append(collector)

    def unregister(self, collector: Collector) -> None:
        super().unregister(collector)
        if collector in self._live:
            self._live.remove(collector)

    def live_collectors(self) -> tuple[Collector, ...]:
        return tuple(self._live)


class _ClusterCollector(Collector):
    # Workers: each counts its own requests in flight; a replica takes traffic while any
    # worker sends it some.
    merge_modes: ClassVar[Mapping[str, MergeMode]] = {
        "kvgate_in_flight": "sum",
        "kvgate_replica_healthy": "max",
    }

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster

    def collect(self) -> Iterator[Metric]:
        inflight = GaugeMetricFamily(
            "kvgate_in_flight", "Requests in flight per replica", labels=["replica"]
        )
        healthy = GaugeMetricFamily(
            "kvgate_replica_healthy", "1 when the replica takes traffic", labels=["replica"]
        )
        cluster = self._cluster
        for rid, count in cluster.in_flight.items():
            inflight.add_metric([rid], count)
        for rid in cluster.members:
            healthy.add_metric([rid], 1.0 if cluster.is_healthy(rid) else 0.0)
        yield inflight
        yield healthy


class _HealthCollector(Collector):
    merge_modes: ClassVar[Mapping[str, MergeMode]] = {"kvgate_replica_ejected": "max"}

    def __init__(self, health: HealthMonitor) -> None:
        self._health = health

    def collect(self) -> Iterator[Metric]:
        health = self._health
        ejected = GaugeMetricFamily(
            "kvgate_replica_ejected",
            "1 while the replica is ejected as an outlier (its answers fail far more often)",
            labels=["replica"],
        )
        for rid in health.cluster.members:
            ejected.add_metric([rid], 1.0 if health.outlier_ejected(rid) else 0.0)
        ejections = CounterMetricFamily(
            "kvgate_replica_ejections",
            "Ejections of a replica from service, by reason (probe, connect, stalled, "
            "consecutive_5xx, failure_share)",
            labels=["replica", "reason"],
        )
        for (rid, reason), count in sorted(health.ejections.items()):
            ejections.add_metric([rid, reason], float(count))
        yield ejected
        yield ejections

    def describe(self) -> Iterator[Metric]:
        return iter(())


class _LineageCollector(Collector):
    # Each worker has an index of its own: the sizes add up.
    merge_modes: ClassVar[Mapping[str, MergeMode]] = {
        "kvgate_lineage_blocks": "sum",
        "kvgate_lineage_capacity_blocks": "sum",
        "kvgate_lineages": "sum",
        "kvgate_lineage_tail_bytes": "sum",
    }

    def __init__(self, index: LineageIndex) -> None:
        self._index = index

    def collect(self) -> Iterator[Metric]:
        index = self._index
        for name, doc, value in (
            ("kvgate_lineage_blocks", "Prefix hashes held by the lineage index", len(index)),
            ("kvgate_lineage_capacity_blocks", "Bound of the lineage index", index.capacity),
            ("kvgate_lineages", "Conversations the lineage index remembers", index.lineages),
            (
                "kvgate_lineage_tail_bytes",
                "Bytes of the conversations' last prompts past their last hash",
                index.tail_bytes,
            ),
        ):
            family = GaugeMetricFamily(name, doc)
            family.add_metric([], float(value))
            yield family

    def describe(self) -> Iterator[Metric]:
        return iter(())


class GatewayMetrics:
    def __init__(self, cluster: Cluster, registry: GatewayRegistry | None = None) -> None:
        self.registry = registry or GatewayRegistry()
        r = self.registry
        # What GET /metrics serves; gateway.workers swaps in the merge of all workers.
        self.exposition: Callable[[], Awaitable[bytes]] = self._own_exposition
        self.requests = Counter(
            "kvgate_requests", "Requests answered", ["endpoint", "replica", "status"], registry=r
        )
        self.errors = Counter("kvgate_errors", "Gateway-made error responses", ["code"], registry=r)
        self.latency = Histogram(
            "kvgate_request_duration_seconds",
            "Request start to last byte",
            ["endpoint", "stream"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttfb = Histogram(
            "kvgate_ttfb_seconds",
            "Request start to first response byte",
            ["endpoint", "stream"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.retries = Counter("kvgate_retries", "Attempts after the first", ["reason"], registry=r)
        self.decisions = Counter(
            "kvgate_routing_decisions", "Routing decisions", ["policy", "reason"], registry=r
        )
        self.disconnects = Counter(
            "kvgate_client_disconnects", "Clients that left early", ["phase"], registry=r
        )
        self.upstream_failures = Counter(
            "kvgate_upstream_failures",
            "Failed attempts per replica",
            ["replica", "kind"],
            registry=r,
        )
        self._register_token_metrics(r)
        self._cluster = cluster
        r.register(_ClusterCollector(cluster))
        # label tuple -> child; prometheus_client's labels() takes a lock on every call.
        self._children: dict[tuple[object, ...], Callable[..., None]] = {}

    def _child(self, metric: Counter | Histogram, method: str, *labels: str) -> Callable[..., None]:
        key = (id(metric), *labels)
        fn = self._children.get(key)
        if fn is None:
            fn = getattr(metric.labels(*labels), method)
            self._children[key] = fn
        return fn

    def _register_token_metrics(self, r: CollectorRegistry) -> None:
        by_replica = ["model", "replica"]
        by_pool = ["model", "replica", "pool"]
        self.ttft = Histogram(
            "kvgate_time_to_first_token_seconds",
            "Request arrival to the first SSE event carrying a token (streams)",
            by_replica,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kvgate_inter_token_latency_seconds",
            "Time between two streamed tokens as relayed (streams)",
            by_replica,
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "kvgate_time_per_output_token_seconds",
            "Per stream: (last token - first token) / (output tokens - 1)",
            by_replica,
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvgate_e2e_request_latency_seconds",
            "Request arrival to its last byte, per model and serving replica",
            by_replica,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvgate_prompt_tokens",
            "Prompt tokens the engines reported (cached included)",
            by_pool,
            registry=r,
        )
        self.cached_tokens = Counter(
            "kvgate_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache",
            by_pool,
            registry=r,
        )
        self.generation_tokens = Counter(
            "kvgate_generation_tokens",
            "Output tokens the engines reported",
            by_pool,
            registry=r,
        )
        by_policy = ["replica", "policy"]
        self.cache_predicted = Counter(
            "kvgate_cache_predicted_tokens",
            "Cached prompt tokens the router expected on the replica it chose",
            by_policy,
            registry=r,
        )
        self.cache_best = Counter(
            "kvgate_cache_best_tokens",
            "Cached prompt tokens the router estimated on the best replica of all",
            by_policy,
            registry=r,
        )
        self.cache_achieved = Counter(
            "kvgate_cache_achieved_tokens",
            "Cached prompt tokens the engine reported, for requests with a prediction",
            by_policy,
            registry=r,
        )
        self.cache_error = Histogram(
            "kvgate_cache_prediction_error_tokens",
            "Per request: cached tokens the engine reported minus those predicted",
            by_policy,
            buckets=CACHE_ERROR_BUCKETS,
            registry=r,
        )
        self.replica_cost = Counter(
            "kvgate_replica_cost",
            "Price units spent: replica price per hour x time with a request in flight",
            ["replica", "pool"],
            registry=r,
        )

    def model_label(self, model: str) -> str:
        known = self._cluster.known_models()
        return model if known is None or model in known else OTHER_MODEL

    def stream_timer(self, model: str, replica: str, t0: float) -> StreamTimer:
        """A timer for one relayed stream that arrived at `t0` (time.perf_counter)."""
        m = self.model_label(model)
        return StreamTimer(
            t0,
            self._child(self.ttft, "observe", m, replica),
            self._child(self.itl, "observe", m, replica),
            self._child(self.tpot, "observe", m, replica),
        )

    def served(
        self,
        model: str,
        replica: str,
        pool: str,
        latency: float,
        prompt: int | None,
        cached: int | None,
        completion: int | None,
    ) -> None:
        """One request `replica` answered: end-to-end latency and the tokens it reported."""
        self._child(self.e2e, "observe", model, replica)(latency)
        if prompt:
            self._child(self.prompt_tokens, "inc", model, replica, pool)(prompt)
        if cached:
            self._child(self.cached_tokens, "inc", model, replica, pool)(cached)
        if completion:
            self._child(self.generation_tokens, "inc", model, replica, pool)(completion)

    def cache_forecast(
        self, replica: str, policy: str, predicted: int, best: int, achieved: int
    ) -> None:
        """One request's cache prediction on `replica` against what its engine reported."""
        self._child(self.cache_predicted, "inc", replica, policy)(predicted)
        self._child(self.cache_best, "inc", replica, policy)(best)
        self._child(self.cache_achieved, "inc", replica, policy)(achieved)
        self._child(self.cache_error, "observe", replica, policy)(achieved - predicted)

    def charge(self, replica: str, pool: str, amount: float) -> None:
        self._child(self.replica_cost, "inc", replica, pool)(amount)

    def request_done(
        self,
        endpoint: str,
        replica: str,
        status: int,
        stream: bool,
        latency: float,
        ttfb: float | None,
    ) -> None:
        s = "true" if stream else "false"
        self._child(self.requests, "inc", endpoint, replica, str(status))()
        self._child(self.latency, "observe", endpoint, s)(latency)
        if ttfb is not None:
            self._child(self.ttfb, "observe", endpoint, s)(ttfb)

    def error(self, code: str) -> None:
        self._child(self.errors, "inc", code)()

    def retry(self, reason: str) -> None:
        self._child(self.retries, "inc", reason)()

    def decision(self, policy: str, reason: str) -> None:
        self._child(self.decisions, "inc", policy, reason)()

    def disconnect(self, phase: str) -> None:
        self._child(self.disconnects, "inc", phase)()

    def upstream_failure(self, replica: str, kind: str) -> None:
        self._child(self.upstream_failures, "inc", replica, kind)()

    def watch_health(self, health: HealthMonitor) -> None:
        """Export outlier ejections, read at scrape time (nothing on the request path)."""
        self.registry.register(_HealthCollector(health))

    def watch_lineage(self, index: LineageIndex) -> None:
        """Export the lineage index's size, read at scrape time (nothing on the request path)."""
        self.registry.register(_LineageCollector(index))

    def render(self) -> bytes:
        """This process's own series (with `--workers N`, one worker's)."""
        return generate_latest(self.registry)

    async def _own_exposition(self) -> bytes:
        return generate_latest(self.registry)
