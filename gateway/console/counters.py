"""Reading the gateway's own Prometheus series back, and turning totals into rates.

The sampler reads the app's registry every few seconds instead of keeping counters of its
own, so nothing is added to the request path: every series read here is already counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry

# (series name, labels as sorted items) -> value
Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]

SERIES = frozenset(
    {
        "kvgate_requests_total",
        "kvgate_errors_total",
        "kvgate_routing_decisions_total",
        "kvgate_retries_total",
        "kvgate_upstream_failures_total",
        "kvgate_admission_queue_depth",
        "kvgate_admission_wait_seconds_count",
        "kvgate_admission_wait_seconds_sum",
        "kvgate_admission_rejected_total",
        "kvgate_pd_decisions_total",
        "kvgate_pd_handoffs_total",
    }
)


def read_series(registry: CollectorRegistry, names: Iterable[str] = SERIES) -> Samples:
    wanted = frozenset(names)
    out: Samples = {name: {} for name in wanted}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name in wanted:
                out[sample.name][tuple(sorted(sample.labels.items()))] = sample.value
    return out


def by_label(series: Mapping[tuple[tuple[str, str], ...], float], *labels: str) -> dict[str, float]:
    """Sum a series' values grouped by `labels` (joined by '/' when several)."""
    out: dict[str, float] = {}
    for key, value in series.items():
        items = dict(key)
        name = "/".join(items.get(label, "") for label in labels)
        out[name] = out.get(name, 0.0) + value
    return out


class Rates:
    """Per-second rates of named totals between two successive `update` calls."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._at: float | None = None

    def update(self, now: float, totals: Mapping[str, float]) -> dict[str, float]:
        at, last = self._at, self._last
        self._at, self._last = now, dict(totals)
        if at is None or now <= at:
            return {}
        dt = now - at
        out: dict[str, float] = {}
        for name, value in totals.items():
            before = last.get(name)
            if before is None:
                continue  # new since the last call: its total spans an unknown interval
            # A total that went down was reset (e.g. a replica removed and re-added).
            out[name] = (value - before if value >= before else value) / dt
        return out


def replica_failures(series: Samples) -> dict[str, tuple[float, float]]:
    """Per replica: (failed attempts, attempts) so far. A failed attempt is one the gateway
    gave up on (connect error, timeout, a retried 5xx: kvgate_upstream_failures_total) or a
    5xx the engine answered and the gateway relayed; attempts are those plus the requests
    the replica answered. A replica failing 20% of its requests with 503 reads 0.2 here
    even while retries hide every failure from the clients."""
    failed = by_label(series.get("kvgate_upstream_failures_total", {}), "replica")
    out: dict[str, tuple[float, float]] = {}
    for key, value in series.get("kvgate_requests_total", {}).items():
        labels = dict(key)
        replica = labels.get("replica", "")
        if not replica:
            continue
        bad, total = out.get(replica, (0.0, 0.0))
        bad += value if labels.get("status", "").startswith("5") else 0.0
        out[replica] = (bad, total + value)
    for replica, value in failed.items():
        if replica:
            bad, total = out.get(replica, (0.0, 0.0))
            out[replica] = (bad + value, total + value)
    return out
