"""`kvgate plan --trace`: how many replicas of each pool a trace needs, and what it costs.

Each pool (a card, its tensor-parallel degree, a price) becomes a simulated engine profile
(`perf.sim_profile`, sized by the pool's memory budget) and the trace is run through
`kvgate simulate` (the real routing policy, the engines' KV caches and batching) at growing
replica counts, doubling until the TTFT target is met and then bisecting. Costs are counted
in total tokens (prompt + output): agent traffic is mostly prompt, and a cost per output
token overstates it by the input:output ratio.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.plan.memory import Budget
from gateway.plan.perf import sim_profile
from gateway.trace.format import Trace
from gateway.trace.simulate import SimulationOptions, SimulationResult, simulate
from gateway.trace.stats import compute_cost

TTFT_PERCENTILES = ("p50", "p90", "p99", "mean")


@dataclass(frozen=True, slots=True)
class Pool:
    label: str
    budget: Budget
    price_per_card_hour: float | None = None

    @property
    def cards_per_replica(self) -> int:
        return self.budget.settings.tp


@dataclass(frozen=True, slots=True)
class Point:
    """One simulated replica count."""

    replicas: int
    ttft_s: float  # at the chosen percentile
    ttft_p50_s: float
    hit_rate: float | None
    errors: int
    total_tokens_per_s: float
    output_tokens_per_s: float
    cost_per_m_total: float | None
    cost_per_m_output: float | None
    preemptions: int


@dataclass(frozen=True, slots=True)
class PoolPlan:
    pool: Pool
    points: tuple[Point, ...]
    needed: Point | None  # the fewest replicas meeting the target
    target_ttft_s: float
    percentile: str
    too_long: int = 0  # requests over the engine's context: rejected at any replica count
    impossible: tuple[str, ...] = ()  # the placement's severe issues: nothing simulated

    def as_dict(self) -> dict[str, Any]:
        def point(p: Point) -> dict[str, Any]:
            return {
                "replicas": p.replicas,
                "cards": p.replicas * self.pool.cards_per_replica,
                f"ttft_{self.percentile}_s": p.ttft_s,
                "ttft_p50_s": p.ttft_p50_s,
                "hit_rate": p.hit_rate,
                "errors": p.errors,
                "total_tokens_per_s": p.total_tokens_per_s,
                "output_tokens_per_s": p.output_tokens_per_s,
                "cost_per_million_total_tokens": p.cost_per_m_total,
                "cost_per_million_output_tokens": p.cost_per_m_output,
                "preemptions": p.preemptions,
            }

        return {
            "pool": self.pool.label,
            "card": self.pool.budget.card.name,
            "tensor_parallel": self.pool.cards_per_replica,
            "price_per_card_hour": self.pool.price_per_card_hour,
            "kv_tokens_per_replica": self.pool.budget.kv_tokens,
            "target_ttft_s": self.target_ttft_s,
            "percentile": self.percentile,
            "requests_over_context": self.too_long,
            "impossible": list(self.impossible),
            "needed": None if self.needed is None else point(self.needed),
            "points": [point(p) for p in self.points],
        }


@dataclass(frozen=True, slots=True)
class TraceShape:
    requests: int
    duration_s: float
    input_p50: float
    output_p50: float
    ratio: float  # total input / total output
    total_input: int
    total_output: int

    @classmethod
    def of(cls, trace: Trace) -> TraceShape:
        recs = trace.records
        inputs = [r.input_tokens for r in recs] or [0]
        outputs = [r.output_tokens for r in recs] or [0]
        span = recs[-1].arrival_s - recs[0].arrival_s if len(recs) > 1 else 0.0
        total_in, total_out = sum(inputs), sum(outputs)
        return cls(
            len(recs),
            span,
            statistics.median(inputs),
            statistics.median(outputs),
            total_in / total_out if total_out else math.inf,
            total_in,
            total_out,
        )

    @property
    def mean_context(self) -> int:
        n = max(1, self.requests)
        return max(1, (self.total_input + self.total_output) // n)


@dataclass(frozen=True, slots=True)
class SimSettings:
    policy: str = "lineage"
    speedup: float = 1.0
    max_replicas: int = 64
    sessions: bool = True
    seed: int = 0
    max_output_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _ttft(result: SimulationResult, percentile: str) -> float:
    value = getattr(result.report.ttft_s, percentile)
    return float(value) if not math.isnan(value) else math.inf


def _point(pool: Pool, result: SimulationResult, percentile: str) -> Point:
    rep = result.report
    cost_total = cost_output = None
    replicas = result.options.replicas
    if pool.price_per_card_hour is not None and rep.total_tokens_per_s > 0:
        cost = compute_cost(
            rep.prompt_tokens + rep.output_tokens,
            rep.output_tokens,
            pool.price_per_card_hour,
            rep.total_tokens_per_s,
            replicas * pool.cards_per_replica,
        )
        cost_total, cost_output = cost.per_million_total, cost.per_million_output
    return Point(
        replicas,
        _ttft(result, percentile),
        _ttft(result, "p50"),
        rep.hit_rate,
        rep.errors,
        rep.total_tokens_per_s,
        rep.output_tokens_per_s,
        cost_total,
        cost_output,
        result.preemptions,
    )


def plan_pool(
    trace: Trace,
    pool: Pool,
    target_ttft_s: float,
    *,
    percentile: str = "p90",
    sim: SimSettings | None = None,
    progress: Callable[[str], None] | None = None,
) -> PoolPlan:
    if percentile not in TTFT_PERCENTILES:
        raise ValueError(f"percentile must be one of {', '.join(TTFT_PERCENTILES)}")
    if target_ttft_s <= 0:
        raise ValueError("target TTFT must be positive")
    o = sim or SimSettings()
    if not pool.budget.fits:
        reasons = tuple(i.message for i in pool.budget.issues if i.severe)
        return PoolPlan(pool, (), None, target_ttft_s, percentile, impossible=reasons)
    shape = TraceShape.of(trace)
    profile = sim_profile(pool.budget, name=pool.label, context=shape.mean_context)
    limit = min(profile.max_model_len, profile.kv_capacity_tokens)
    too_long = sum(
        1 for r in trace.records if max(1, r.input_tokens) + max(1, r.output_tokens) > limit
    )
    points: dict[int, Point] = {}

    def run(n: int) -> Point:
        if n not in points:
            result = simulate(
                trace,
                SimulationOptions(
                    replicas=n,
                    policy=o.policy,
                    policy_config=o.extra,
                    profile=profile,
                    speedup=o.speedup,
                    max_output_tokens=o.max_output_tokens,
                    seed=o.seed,
                    sessions=o.sessions,
                ),
            )
            points[n] = _point(pool, result, percentile)
            if progress is not None:
                p = points[n]
                progress(f"{pool.label}: {n} replica(s): TTFT {percentile} {p.ttft_s:.2f} s")
        return points[n]

    def meets(p: Point) -> bool:
        return p.ttft_s <= target_ttft_s and p.errors <= too_long

    lo, hi = 0, 1
    while not meets(run(hi)):
        lo = hi
        if hi >= o.max_replicas:
            hi = 0
            break
        hi = min(o.max_replicas, hi * 2)
    if hi:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if meets(run(mid)):
                hi = mid
            else:
                lo = mid
    ordered = tuple(points[n] for n in sorted(points))
    return PoolPlan(pool, ordered, points[hi] if hi else None, target_ttft_s, percentile, too_long)


def plan_pools(
    trace: Trace, pools: Sequence[Pool], target_ttft_s: float, **kwargs: Any
) -> list[PoolPlan]:
    return [plan_pool(trace, pool, target_ttft_s, **kwargs) for pool in pools]


def render(shape: TraceShape, plans: Sequence[PoolPlan], source: str = "") -> str:
    lines = [
        (
            f"trace    {source} {shape.requests:,} requests over {shape.duration_s:,.0f} s;"
            f" input P50 {shape.input_p50:,.0f}, output P50 {shape.output_p50:,.0f} tokens;"
            f" input:output {shape.ratio:,.0f}:1 by volume"
        ),
        "",
        (
            f"{'pool':16} {'card x tp':>14} {'replicas':>8} {'cards':>6} {'TTFT':>9} {'P50':>8}"
            f" {'hit':>6} {'total tok/s':>12} {'out tok/s':>10} {'$/M total':>10} {'$/M out':>9}"
        ),
    ]
    for plan in plans:
        p = plan.needed
        card = f"{plan.pool.budget.card.name} x {plan.pool.cards_per_replica}"
        if plan.impossible:
            lines.append(f"{plan.pool.label:16} {card:>14}  impossible: {plan.impossible[0]}")
            continue
        if p is None:
            tried = max((q.replicas for q in plan.points), default=0)
            best = min(plan.points, key=lambda q: q.ttft_s, default=None)
            why = "raise --max-replicas, or see errors/preemptions"
            if best is not None and len(plan.points) > 1:
                ordered = sorted(plan.points, key=lambda q: q.replicas)
                if ordered[-1].ttft_s >= 0.9 * ordered[-2].ttft_s:
                    why = (
                        f"TTFT levels off at {best.ttft_s:.2f} s: one prompt's prefill,"
                        " more replicas do not shorten it (more tensor parallelism does)"
                    )
            lines.append(
                f"{plan.pool.label:16} {card:>14}  target not met with up to {tried}"
                f" replicas ({why})"
            )
            continue
        cost_t = f"{p.cost_per_m_total:.4f}" if p.cost_per_m_total is not None else "-"
        cost_o = f"{p.cost_per_m_output:.2f}" if p.cost_per_m_output is not None else "-"
        hit = f"{p.hit_rate:.1%}" if p.hit_rate is not None else "-"
        lines.append(
            f"{plan.pool.label:16} {card:>14} {p.replicas:>8} "
            f"{p.replicas * plan.pool.cards_per_replica:>6} {p.ttft_s:>8.2f}s {p.ttft_p50_s:>7.2f}s"
            f" {hit:>6} {p.total_tokens_per_s:>12,.0f} {p.output_tokens_per_s:>10,.1f}"
            f" {cost_t:>10} {cost_o:>9}"
        )
    for plan in plans:
        if plan.too_long:
            lines.append(
                f"{plan.pool.label}: {plan.too_long} request(s) longer than the"
                f" engine's context ({plan.pool.budget.max_model_len:,} tokens or its"
                " KV), rejected at any replica count"
            )
    if plans:
        t = plans[0]
        lines.append(
            f"TTFT is {t.percentile}; target {t.target_ttft_s:g} s with no other"
            " errors. Costs per million tokens at the pool's card price."
        )
        needed = [p for p in plans if p.needed is not None]
        if needed:
            ratio = needed[0].needed
            if ratio is not None and ratio.output_tokens_per_s > 0:
                lines.append(
                    f"Counting output tokens only would understate throughput"
                    f" {ratio.total_tokens_per_s / ratio.output_tokens_per_s:,.0f}x."
                )
    return "\n".join(lines)
