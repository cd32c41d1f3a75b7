"""Prometheus view of the pools: read from the published snapshot and the cost ledger at
scrape time, so the request path never touches a metric object for them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import ClassVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from gateway.metric_merge import MergeMode
from gateway.pools.controller import WeightSnapshot
from gateway.pools.cost import BASES, CostLedger

# name -> help; the reference table in the docs is checked against this.
METRICS: dict[str, str] = {
    "kvgate_pool_weight": "Traffic share the weight controller gives each pool (0..1).",
    "kvgate_pool_utilisation": "Mean slot/KV utilisation of the pool's healthy replicas.",
    "kvgate_pool_weight_changes": "Weight changes made by the controller.",
    "kvgate_pool_weight_last_change_timestamp_seconds": "When the weights last changed.",
    "kvgate_pool_weight_last_change_reason": "1 for the code of the last weight change.",
    "kvgate_pool_tokens": "Tokens served per pool and kind (prompt includes cached).",
    "kvgate_pool_cost": "Accumulated cost per pool and basis, in price units.",
    "kvgate_pool_cost_per_1k_tokens": "Cost per 1,000 total (prompt + generated) tokens.",
    "kvgate_pool_cost_per_1k_output_tokens": "Cost per 1,000 generated tokens.",
    "kvgate_pool_throughput_tokens_per_second": "Total tokens per second over the last minute.",
    "kvgate_pool_warm_moves": "Sessions' prefix warm-ups by source pool, target pool, result.",
}

WarmCountsSource = Callable[[], Mapping[tuple[str, str, str], int]]


class PoolCollector(Collector):
    # Workers: each runs its own weight controller and cost ledger. Ratios do not add up,
    # so the per-1K costs and the last change's code stay per worker.
    merge_modes: ClassVar[Mapping[str, MergeMode]] = {
        "kvgate_pool_weight": "latest",
        "kvgate_pool_utilisation": "latest",
        "kvgate_pool_weight_last_change_timestamp_seconds": "max",
        "kvgate_pool_weight_last_change_reason": "worker",
        "kvgate_pool_cost": "sum",
        "kvgate_pool_cost_per_1k_tokens": "worker",
        "kvgate_pool_cost_per_1k_output_tokens": "worker",
        "kvgate_pool_throughput_tokens_per_second": "sum",
    }

    def __init__(
        self,
        snapshot: Callable[[], WeightSnapshot],
        ledger: CostLedger | None = None,
        warm_counts: WarmCountsSource | None = None,
    ) -> None:
        self._snapshot = snapshot
        self._ledger = ledger
        self._warm_counts = warm_counts

    def _gauge(self, name: str, labels: list[str]) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, METRICS[name], labels=labels)

    def collect(self) -> Iterable[Metric]:
        snap = self._snapshot()
        weight = self._gauge("kvgate_pool_weight", ["pool"])
        for pool, w in sorted(snap.weights.items()):
            weight.add_metric([pool], w)
        util = self._gauge("kvgate_pool_utilisation", ["pool"])
        for pool, u in sorted(snap.utilisation.items()):
            if u is not None:
                util.add_metric([pool], u)
        changes = CounterMetricFamily(
            "kvgate_pool_weight_changes", METRICS["kvgate_pool_weight_changes"]
        )
        changes.add_metric([], snap.version)
        last = self._gauge("kvgate_pool_weight_last_change_timestamp_seconds", [])
        last.add_metric([], snap.changed_at)
        reason = self._gauge("kvgate_pool_weight_last_change_reason", ["code"])
        reason.add_metric([snap.code], 1.0)
        yield from (weight, util, changes, last, reason)
        if self._ledger is not None:
            yield from self._cost_metrics()
        warm = CounterMetricFamily(
            "kvgate_pool_warm_moves",
            METRICS["kvgate_pool_warm_moves"],
            labels=["from_pool", "to_pool", "result"],
        )
        counts = self._warm_counts() if self._warm_counts is not None else {}
        for (src, dst, result), n in sorted(counts.items()):
            warm.add_metric([src, dst, result], n)
        yield warm

    def _cost_metrics(self) -> Iterable[Metric]:
        assert self._ledger is not None
        summary = self._ledger.summary()
        tokens = CounterMetricFamily(
            "kvgate_pool_tokens", METRICS["kvgate_pool_tokens"], labels=["pool", "kind"]
        )
        cost = self._gauge("kvgate_pool_cost", ["pool", "basis"])
        per_total = self._gauge("kvgate_pool_cost_per_1k_tokens", ["pool", "basis"])
        per_out = self._gauge("kvgate_pool_cost_per_1k_output_tokens", ["pool", "basis"])
        tps = self._gauge("kvgate_pool_throughput_tokens_per_second", ["pool"])
        for pool, pc in sorted(summary.items()):
            tokens.add_metric([pool, "prompt"], pc.prompt_tokens)
            tokens.add_metric([pool, "cached_prompt"], pc.cached_tokens)
            tokens.add_metric([pool, "generated"], pc.completion_tokens)
            tps.add_metric([pool], pc.throughput_tps)
            for basis in BASES:
                cost.add_metric([pool, basis], pc.cost[basis])
                total = pc.per_1k_total(basis)
                if total is not None:
                    per_total.add_metric([pool, basis], total)
                output = pc.per_1k_output(basis)
                if output is not None:
                    per_out.add_metric([pool, basis], output)
        yield from (tokens, cost, per_total, per_out, tps)


def register(
    registry: CollectorRegistry,
    snapshot: Callable[[], WeightSnapshot],
    ledger: CostLedger | None = None,
    warm_counts: WarmCountsSource | None = None,
) -> PoolCollector:
    collector = PoolCollector(snapshot, ledger, warm_counts)
    registry.register(collector)
    return collector
