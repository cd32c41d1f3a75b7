"""The diagnosis of a fleet: each engine's checks (gateway.doctor.engine), then what only
shows across replicas and through the gateway (hot replicas, stale scrapes, hit rates
below what routing predicts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gateway.doctor.engine import check_engine
from gateway.doctor.findings import (
    CONTINUATION_REASONS,
    HIT_MIN_DECISIONS,
    HOT_FACTOR,
    HOT_MIN,
    Finding,
    Hints,
)
from gateway.doctor.probe import EngineSnapshot, GatewaySnapshot
from gateway.doctor.through import check_through_gateway


# ---- across replicas ------------------------------------------------------------------
def check_cluster(
    latest: Mapping[str, EngineSnapshot], gateway: GatewaySnapshot | None, hints: Hints
) -> list[Finding]:
    out = _hot(latest)
    if gateway is not None:
        out += _gateway(gateway, hints)
        if gateway.error is None:
            out += check_through_gateway(gateway)
        out += _hit_vs_routing(latest, gateway, hints)
    elif hints.expected_hit_rate is not None:
        out += _hit_vs_expected(latest, hints.expected_hit_rate)
    return out


def _hot(latest: Mapping[str, EngineSnapshot]) -> list[Finding]:
    loads = {
        u: s.reading.running + s.reading.waiting for u, s in latest.items() if s.reading is not None
    }
    if len(loads) < 2:
        return []
    url, top = max(loads.items(), key=lambda kv: kv[1])
    others = [v for u, v in loads.items() if u != url]
    mean = sum(others) / len(others)
    if top < HOT_MIN or top < HOT_FACTOR * mean + 2:
        return []
    shown = ", ".join(f"{v:.0f}" for v in loads.values())
    return [
        Finding(
            "hot_replica",
            "warning",
            url,
            "one replica is much busier than the others",
            (
                f"running + waiting per replica: {shown}",
                f"{top:.0f} here vs a mean of {mean:.1f} on the others ({top / max(mean, 1):.1f}x)",
            ),
            "a few long sessions stuck to one replica (raise the lineage policy's load bound), a"
            " replica missing from the gateway's list, or clients bypassing the gateway",
        )
    ]


def _gateway(g: GatewaySnapshot, hints: Hints) -> list[Finding]:
    if g.error is not None:
        return [
            Finding(
                "gateway_unreachable",
                "warning",
                g.url,
                "gateway did not answer",
                (f"GET {g.url}/metrics: {g.error}",),
                "check the gateway process",
            )
        ]
    out: list[Finding] = []
    for replica, age in sorted(g.scrape_age_s.items()):
        limit = g.scrape_fresh_for_s.get(replica, hints.stale_after_s)
        if age > limit:
            errors = g.scrape_errors.get(replica, 0.0)
            out.append(
                Finding(
                    "stale_metrics",
                    "warning",
                    replica,
                    "the gateway's view of this replica is old",
                    (
                        f"kvgate_scrape_age_seconds {age:.1f} > {limit:g}",
                        f"kvgate_scrape_errors_total {errors:.0f}",
                    ),
                    "the gateway routes on stale load (treated as saturated): check that the"
                    " replica's /metrics answers within scrape.timeout_s",
                )
            )
    return out


def engine_hit_rate(latest: Mapping[str, EngineSnapshot]) -> float | None:
    """Token-weighted over the engines with counters; else the mean of their rates."""
    hits = queries = 0.0
    rates = []
    for snap in latest.values():
        r = snap.reading
        if r is None:
            continue
        if r.counters is not None and r.counters.queries > 0:
            hits += r.counters.hits
            queries += r.counters.queries
        elif r.prefix_hit_rate is not None:
            rates.append(r.prefix_hit_rate)
    if queries:
        return hits / queries
    return sum(rates) / len(rates) if rates else None


def _hit_vs_routing(
    latest: Mapping[str, EngineSnapshot], g: GatewaySnapshot, hints: Hints
) -> list[Finding]:
    total = sum(g.decisions.values())
    hit = engine_hit_rate(latest)
    if hit is None or total < HIT_MIN_DECISIONS:
        return []
    cont = sum(v for k, v in g.decisions.items() if k in CONTINUATION_REASONS)
    share = cont / total
    expected = hints.expected_hit_rate
    if expected is None and share >= 0.5 and hit < 0.5 * share:
        expected = 0.5 * share
    elif expected is None or hit >= expected - 0.2:
        return []
    shares = ", ".join(f"{k} {v:.0f}" for k, v in sorted(g.decisions.items()))
    return [
        Finding(
            "hit_rate_low",
            "warning",
            "cluster",
            "engine prefix hit rate far below what the gateway's routing predicts",
            (
                f"gateway decisions: {shares}: {share:.0%} went to the replica holding their prefix",
                f"engines' prefix hit rate {hit:.1%}, expected at least {expected:.0%}",
            ),
            "the engines evict what routing kept together (KV too small for the sessions' working"
            " set: see KV capacity), or they hash blocks differently (block size, salt)",
        )
    ]


def _hit_vs_expected(latest: Mapping[str, EngineSnapshot], expected: float) -> list[Finding]:
    hit = engine_hit_rate(latest)
    if hit is None or hit >= expected - 0.2:
        return []
    return [
        Finding(
            "hit_rate_low",
            "warning",
            "cluster",
            "engine prefix hit rate far below the expected",
            (f"engines' prefix hit rate {hit:.1%}, expected {expected:.0%} (--expected-hit-rate)",),
            "a routing or eviction problem: route through kvgate, and check KV capacity",
        )
    ]


@dataclass(frozen=True, slots=True)
class Diagnosis:
    findings: tuple[Finding, ...]
    engines: Mapping[str, EngineSnapshot] = field(default_factory=dict)
    hints: Hints = field(default_factory=Hints)

    @property
    def severe(self) -> bool:
        return any(f.severe for f in self.findings)


def diagnose(
    samples: Mapping[str, Sequence[EngineSnapshot]], gateway: GatewaySnapshot | None, hints: Hints
) -> Diagnosis:
    findings: list[Finding] = []
    for url, series in samples.items():
        findings += check_engine(url, series, hints)
    latest = {u: s[-1] for u, s in samples.items()}
    findings += check_cluster(latest, gateway, hints)
    order = {"severe": 0, "warning": 1}
    findings.sort(key=lambda f: order.get(f.severity, 2))
    return Diagnosis(tuple(findings), latest, hints)
