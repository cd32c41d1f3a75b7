"""Counters for PD decisions and hand-offs, registered on the app's own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from gateway.pd.decision import PDDecision


class PDMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "kvgate_pd_decisions",
            "PD decisions per request, by outcome and reason",
            ("model", "decision", "reason"),
            registry=registry,
        )
        self.handoffs = Counter(
            "kvgate_pd_handoffs",
            "Disaggregated requests by protocol and how they ended",
            ("protocol", "outcome"),
            registry=registry,
        )
        self.kv_bytes = Counter(
            "kvgate_pd_kv_bytes_estimated",
            "Estimated KV bytes moved from prefill to decode replicas",
            ("model",),
            registry=registry,
        )

    def decided(self, model: str, decision: PDDecision) -> None:
        outcome = "disaggregate" if decision.disaggregate else "colocated"
        self.decisions.labels(model, outcome, decision.reason).inc()

    def handoff(self, protocol: str, outcome: str) -> None:
        self.handoffs.labels(protocol, outcome).inc()

    def moved(self, model: str, kv_bytes: int) -> None:
        self.kv_bytes.labels(model).inc(kv_bytes)
