"""The tier figures of a capture (gateway.tiers): attempts, tokens and scores per tier,
entry reasons, escalations by failed check. Capture records are attempts: an escalated
request is one record on the tier it left and one (reason `escalated:<check>`) on the
tier it went to."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.trace.format import TraceRecord


@dataclass(frozen=True, slots=True)
class TierRow:
    tier: str
    attempts: int
    input_tokens: int
    output_tokens: int
    mean_score: float | None


@dataclass(frozen=True, slots=True)
class TierSummary:
    rows: tuple[TierRow, ...]
    reasons: tuple[tuple[str, int], ...]
    escalations: tuple[tuple[str, int], ...]
    untiered: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "tiers": [
                {
                    "tier": r.tier,
                    "attempts": r.attempts,
                    "input_tokens": r.input_tokens,
                    "output_tokens": r.output_tokens,
                    "mean_score": r.mean_score,
                }
                for r in self.rows
            ],
            "reasons": dict(self.reasons),
            "escalations": dict(self.escalations),
            "untiered": self.untiered,
        }

    def render(self) -> list[str]:
        tiered = sum(r.attempts for r in self.rows) or 1
        lines = []
        for r in self.rows:
            score = "" if r.mean_score is None else f", mean score {r.mean_score:.3f}"
            lines.append(
                f"tier {r.tier:<11} {r.attempts:,} attempts ({r.attempts / tiered:.1%}),"
                f" {r.input_tokens + r.output_tokens:,} tokens{score}"
            )
        reasons = ", ".join(f"{name} {n:,}" for name, n in self.reasons)
        lines.append(f"tier reasons     {reasons}")
        escalated = ", ".join(f"{name} {n:,}" for name, n in self.escalations) or "none"
        lines.append(f"escalations      {escalated}")
        return lines


def tier_summary(records: Sequence[TraceRecord]) -> TierSummary | None:
    """None when no record carries a tier."""
    attempts: Counter[str] = Counter()
    tokens_in: Counter[str] = Counter()
    tokens_out: Counter[str] = Counter()
    scores: dict[str, list[float]] = {}
    reasons: Counter[str] = Counter()
    escalations: Counter[str] = Counter()
    untiered = 0
    order: list[str] = []
    for r in records:
        if r.tier is None:
            untiered += 1
            continue
        if r.tier not in attempts:
            order.append(r.tier)
        attempts[r.tier] += 1
        tokens_in[r.tier] += r.input_tokens
        tokens_out[r.tier] += r.output_tokens
        if r.tier_score is not None:
            scores.setdefault(r.tier, []).append(r.tier_score)
        reason = r.tier_reason or "unknown"
        kind, _, check = reason.partition(":")
        if kind == "escalated":
            escalations[check] += 1
        reasons[kind] += 1
    if not attempts:
        return None
    rows = tuple(
        TierRow(
            tier,
            attempts[tier],
            tokens_in[tier],
            tokens_out[tier],
            sum(scores[tier]) / len(scores[tier]) if tier in scores else None,
        )
        for tier in order
    )
    return TierSummary(
        rows, tuple(sorted(reasons.items())), tuple(sorted(escalations.items())), untiered
    )
