"""Prometheus series of the store, registered on the app's own registry (never the global one)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass(frozen=True, slots=True)
class StoreMetrics:
    registry: CollectorRegistry
    degraded: Gauge
    errors: Counter
    request_lookups: Counter
    sync_seconds: Histogram
    resyncs: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> StoreMetrics:
        registry = registry if registry is not None else CollectorRegistry()
        return cls(
            registry=registry,
            degraded=Gauge(
                "kvgate_store_degraded",
                "1 while the shared store is unreachable and state is served locally",
                multiprocess_mode="livemax",
                registry=registry,
            ),
            errors=Counter(
                "kvgate_store_errors_total",
                "Failed or timed-out shared-store operations",
                ["op"],
                registry=registry,
            ),
            request_lookups=Counter(
                "kvgate_store_lookups_total",
                "Session lookups on the request path by where they were answered",
                ["source"],
                registry=registry,
            ),
            sync_seconds=Histogram(
                "kvgate_store_sync_seconds",
                "Duration of one background flush-and-pull round trip",
                buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5),
                registry=registry,
            ),
            resyncs=Counter(
                "kvgate_store_resyncs_total",
                "Full resynchronisations after (re)connecting to the shared store",
                registry=registry,
            ),
        )
