"""The report shared by `kvgate trace replay` and `kvgate simulate`.

Both produce one `RequestResult` per trace request and summarise them the same way, so
their figures can be compared line by line.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class Percentiles:
    p50: float
    p90: float
    p99: float
    mean: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        mean = sum(values) / len(values) if values else math.nan
        return cls(percentile(values, 50), percentile(values, 90), percentile(values, 99), mean)

    def as_dict(self) -> dict[str, float]:
        return {"p50": self.p50, "p90": self.p90, "p99": self.p99, "mean": self.mean}


@dataclass(frozen=True, slots=True)
class RequestResult:
    """One replayed (or simulated) request. Times are seconds from the run's start."""

    index: int
    start_s: float
    end_s: float
    ttft_s: float | None
    itl_s: tuple[float, ...] = ()
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None
    replica: str | None = None


@dataclass(frozen=True, slots=True)
class ReplayReport:
    requests: int
    ok: int
    errors: int
    duration_s: float
    ttft_s: Percentiles
    itl_s: Percentiles
    prompt_tokens: int
    output_tokens: int
    total_tokens_per_s: float
    output_tokens_per_s: float
    # Engines' own view: sum(cached_tokens) / sum(prompt_tokens) over requests reporting it.
    hit_rate: float | None
    error_kinds: Mapping[str, int] = field(default_factory=dict)
    # Simulation only: per-replica share of prompt tokens and max/mean of those.
    replica_tokens: Mapping[str, int] = field(default_factory=dict)
    load_imbalance: float | None = None
    label: str = "replay"
    # Per request, in trace order (not part of as_dict: can be large).
    results: tuple[RequestResult, ...] = ()

    @classmethod
    def build(
        cls,
        results: Sequence[RequestResult],
        duration_s: float,
        *,
        label: str = "replay",
        replicas: Sequence[str] = (),
    ) -> ReplayReport:
        ok = [r for r in results if r.error is None]
        kinds: dict[str, int] = {}
        for r in results:
            if r.error is not None:
                kinds[r.error] = kinds.get(r.error, 0) + 1
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        itl = [gap for r in ok for gap in r.itl_s]
        prompt = sum(r.prompt_tokens for r in ok)
        output = sum(r.output_tokens for r in ok)
        reporting = [r for r in ok if r.cached_tokens is not None]
        reported_prompt = sum(r.prompt_tokens for r in reporting)
        hit = (
            sum(r.cached_tokens or 0 for r in reporting) / reported_prompt
            if reported_prompt
            else None
        )
        per_replica: dict[str, int] = {name: 0 for name in replicas}
        for r in ok:
            if r.replica is not None:
                per_replica[r.replica] = (
                    per_replica.get(r.replica, 0) + r.prompt_tokens + r.output_tokens
                )
        imbalance = None
        if per_replica and sum(per_replica.values()):
            mean = sum(per_replica.values()) / len(per_replica)
            imbalance = max(per_replica.values()) / mean
        span = duration_s if duration_s > 0 else math.nan
        return cls(
            requests=len(results),
            ok=len(ok),
            errors=len(results) - len(ok),
            duration_s=duration_s,
            ttft_s=Percentiles.of(ttft),
            itl_s=Percentiles.of(itl),
            prompt_tokens=prompt,
            output_tokens=output,
            total_tokens_per_s=(prompt + output) / span,
            output_tokens_per_s=output / span,
            hit_rate=hit,
            error_kinds=kinds,
            replica_tokens=per_replica,
            load_imbalance=imbalance,
            label=label,
            results=tuple(sorted(results, key=lambda r: r.index)),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "requests": self.requests,
            "ok": self.ok,
            "errors": self.errors,
            "error_kinds": dict(self.error_kinds),
            "duration_s": self.duration_s,
            "ttft_s": self.ttft_s.as_dict(),
            "itl_s": self.itl_s.as_dict(),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "total_tokens_per_s": self.total_tokens_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "hit_rate": self.hit_rate,
            "replica_tokens": dict(self.replica_tokens),
            "load_imbalance": self.load_imbalance,
        }

    def render(self) -> str:
        def ms(p: Percentiles) -> str:
            return f"p50 {p.p50 * 1e3:.1f} ms  p90 {p.p90 * 1e3:.1f} ms  p99 {p.p99 * 1e3:.1f} ms"

        lines = [
            (
                f"{self.label}: {self.requests} requests, {self.ok} ok, {self.errors} errors"
                f" in {self.duration_s:.2f} s"
            ),
            f"  TTFT            {ms(self.ttft_s)}",
            f"  inter-token     {ms(self.itl_s)}",
            (
                f"  throughput      {self.total_tokens_per_s:,.0f} total tok/s,"
                f" {self.output_tokens_per_s:,.1f} output tok/s"
            ),
            f"  tokens          {self.prompt_tokens:,} prompt + {self.output_tokens:,} output",
            "  engine hit rate "
            + (
                "n/a (no cached_tokens reported)"
                if self.hit_rate is None
                else f"{self.hit_rate:.1%}"
            ),
        ]
        if self.error_kinds:
            kinds = ", ".join(f"{k}: {v}" for k, v in sorted(self.error_kinds.items()))
            lines.append(f"  errors          {kinds}")
        if self.load_imbalance is not None:
            lines.append(
                f"  load imbalance  {self.load_imbalance:.2f} (max/mean tokens per replica)"
            )
        return "\n".join(lines)
