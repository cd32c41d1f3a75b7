"""Prometheus view of the tiers: read from `TierLedger` at scrape time, so the request path
only adds to plain counters."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import ClassVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.metric_merge import MergeMode

# name -> help; the reference table in docs/tiers.md is checked against this.
METRICS: dict[str, str] = {
    "kvgate_tier_requests": "Answers served per tiered model and tier (escalated attempts too).",
    "kvgate_tier_decisions": "Entry decisions per tiered model, tier and reason kind.",
    "kvgate_tier_escalations": "Escalations per tiered model, tier left and failed check.",
    "kvgate_tier_tokens": "Tokens per tiered model, tier and kind (prompt, completion).",
    "kvgate_tier_cost": "Cost per tiered model and tier, in price_per_1m_tokens units.",
    "kvgate_tier_cost_all_largest": "What the same answers would have cost on the largest tier.",
    "kvgate_tier_cost_saved": "cost_all_largest minus cost (negative: tiering cost more).",
}


class TierLedger:
    """Plain counters the request path adds to (no locks: one event loop per process)."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str]] = Counter()
        self.decisions: Counter[tuple[str, str, str]] = Counter()
        self.escalations: Counter[tuple[str, str, str]] = Counter()
        self.tokens: Counter[tuple[str, str, str]] = Counter()
        self.cost: defaultdict[tuple[str, str], float] = defaultdict(float)
        self.all_largest: defaultdict[str, float] = defaultdict(float)
        # Tokens of the answers clients got (escalated-away attempts not counted).
        self.answered_tokens: Counter[str] = Counter()

    def saved(self) -> dict[str, float]:
        spent: defaultdict[str, float] = defaultdict(float)
        for (model, _), value in self.cost.items():
            spent[model] += value
        return {model: self.all_largest[model] - spent[model] for model in self.all_largest}


class TierCollector(Collector):
    merge_modes: ClassVar[Mapping[str, MergeMode]] = {"kvgate_tier_cost_saved": "sum"}

    def __init__(self, ledger: TierLedger) -> None:
        self._ledger = ledger

    def describe(self) -> Iterable[Metric]:
        return []  # collected at scrape time only

    def collect(self) -> Iterable[Metric]:
        ledger = self._ledger
        requests = CounterMetricFamily(
            "kvgate_tier_requests", METRICS["kvgate_tier_requests"], labels=["model", "tier"]
        )
        for labels, n in sorted(ledger.requests.items()):
            requests.add_metric(list(labels), n)
        decisions = CounterMetricFamily(
            "kvgate_tier_decisions",
            METRICS["kvgate_tier_decisions"],
            labels=["model", "tier", "reason"],
        )
        for labels3, n in sorted(ledger.decisions.items()):
            decisions.add_metric(list(labels3), n)
        escalations = CounterMetricFamily(
            "kvgate_tier_escalations",
            METRICS["kvgate_tier_escalations"],
            labels=["model", "tier", "reason"],
        )
        for labels3, n in sorted(ledger.escalations.items()):
            escalations.add_metric(list(labels3), n)
        tokens = CounterMetricFamily(
            "kvgate_tier_tokens", METRICS["kvgate_tier_tokens"], labels=["model", "tier", "kind"]
        )
        for labels3, n in sorted(ledger.tokens.items()):
            tokens.add_metric(list(labels3), n)
        cost = CounterMetricFamily(
            "kvgate_tier_cost", METRICS["kvgate_tier_cost"], labels=["model", "tier"]
        )
        for labels, value in sorted(ledger.cost.items()):
            cost.add_metric(list(labels), value)
        largest = CounterMetricFamily(
            "kvgate_tier_cost_all_largest",
            METRICS["kvgate_tier_cost_all_largest"],
            labels=["model"],
        )
        for model, value in sorted(ledger.all_largest.items()):
            largest.add_metric([model], value)
        saved = GaugeMetricFamily(
            "kvgate_tier_cost_saved", METRICS["kvgate_tier_cost_saved"], labels=["model"]
        )
        for model, value in sorted(ledger.saved().items()):
            saved.add_metric([model], value)
        return [requests, decisions, escalations, tokens, cost, largest, saved]
