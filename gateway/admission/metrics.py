"""Admission metrics on the app's registry. Queue depth per class is an autoscaling signal.

Nothing here is touched on the fast path: only requests that actually wait are counted.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class AdmissionMetrics:
    def __init__(self, registry: CollectorRegistry, class_names: tuple[str, ...]) -> None:
        self.queue_depth = Gauge(
            "kvgate_admission_queue_depth",
            "Requests waiting in the gateway for a saturated replica, per priority class.",
            ["priority_class"],
            multiprocess_mode="livesum",
            registry=registry,
        )
        self.wait_seconds = Histogram(
            "kvgate_admission_wait_seconds",
            "Time requests waited in the gateway before release, rejection or disconnect.",
            ["priority_class", "outcome"],
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.rejected = Counter(
            "kvgate_admission_rejected_total",
            "Requests answered 429 by admission control.",
            ["priority_class", "reason"],
            registry=registry,
        )
        # Pre-create label sets so dashboards show zeros before the first overload.
        for name in class_names:
            self.queue_depth.labels(name)
            for reason in ("queue_full", "timeout"):
                self.rejected.labels(name, reason)
