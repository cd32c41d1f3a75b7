"""`kvgate plan` without a trace: the budget, the target, the fixes, the hand-off, as text
and as a dict for `--json`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.plan.fit import Suggestion, Target, TargetCheck, check, suggest
from gateway.plan.handoff import Handoff, handoff
from gateway.plan.memory import Budget, capture_sizes
from gateway.plan.perf import Speed, speed


@dataclass(frozen=True, slots=True)
class PlanReport:
    budget: Budget
    speed: Speed
    other_speed: Speed  # the same replica with CUDA graphs the other way
    target: TargetCheck | None
    suggestions: tuple[Suggestion, ...]
    handoffs: tuple[Handoff, ...]
    decode_context: int

    @property
    def ok(self) -> bool:
        return self.budget.fits and (self.target is None or self.target.met)


def make_plan(
    budget: Budget,
    *,
    target: Target | None = None,
    prompts: Sequence[int] = (),
    link_gbps: float = 100.0,
    cached_tokens: int = 0,
    decode_context: int = 4096,
    kv_bytes_per_token: int | None = None,
    interference: float = 1.0,
) -> PlanReport:
    from gateway.plan.memory import budget as rebudget

    other = rebudget(
        budget.model,
        budget.card,
        budget.settings.with_(cuda_graphs=not budget.settings.cuda_graphs),
    )
    checked = check(budget, target) if target is not None else None
    fixes = (
        suggest(budget.model, budget.card, budget.settings, target) if target is not None else []
    )
    hands = tuple(
        handoff(
            budget.model,
            p,
            link_gbps,
            kv_dtype=budget.settings.kv_dtype,
            cached_tokens=cached_tokens,
            kv_bytes_per_token=kv_bytes_per_token,
            prefill_tokens_per_s=speed(budget).prefill_tokens_per_s,
            interference=interference,
        )
        for p in prompts
    )
    return PlanReport(
        budget, speed(budget), speed(other), checked, tuple(fixes), hands, decode_context
    )


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def _decode(s: Speed, context: int, batch: int) -> str:
    return (
        f"{s.decode_tokens_per_s(1, context):,.0f} tok/s one stream,"
        f" {s.decode_tokens_per_s(batch, context):,.0f} tok/s at batch {batch}"
    )


def render(r: PlanReport) -> str:
    b, s, m = r.budget, r.budget.settings, r.budget.model
    per_block = b.kv_bytes_per_token * s.block_size
    graphs = (
        f"CUDA graphs ({len(capture_sizes(s.max_num_seqs))} sizes)"
        if s.cuda_graphs
        else "CUDA graphs (off: enforce_eager)"
    )
    rows = [
        (
            (
                "usable (gpu_memory_utilization"
                f" {s.gpu_memory_utilization:g} x {b.card.memory_gib:g})"
            ),
            b.usable_gib,
        ),
        (f"weights ({b.weight_dtype})", b.weights_gib),
        (f"activations (max_num_batched_tokens {s.max_num_batched_tokens:,})", b.activation_gib),
        (graphs, b.cuda_graph_gib),
        ("runtime (CUDA context, NCCL)", b.runtime_gib),
        ("KV cache", b.kv_gib),
    ]
    total, active = m.total_params, m.active_params_per_token
    lines = [
        f"model    {m.name}: {m.layers} layers, {m.attention_kind};"
        f" {total / 1e9:,.1f}B params" + (f", {active / 1e9:,.1f}B active" if m.is_moe else ""),
        (
            f"card     {b.card.name} x {s.tp} (tensor parallel {s.tp}): {b.card.memory_gib:g} GiB,"
            f" {b.card.bandwidth_tbs:g} TB/s, fp8 {b.card.fp8}, fp4 {b.card.fp4}"
        ),
        (
            f"engine   max_model_len {b.max_model_len:,}, max_num_seqs {s.max_num_seqs},"
            f" max_num_batched_tokens {s.max_num_batched_tokens:,}, kv_cache_dtype {s.kv_dtype},"
            f" block_size {s.block_size}"
        ),
        "",
        f"{'memory per card':58} {'GiB':>8}",
    ]
    lines += [f"  {label:56} {value:8.2f}" for label, value in rows]
    lines.append(
        f"  KV per token per card {b.kv_bytes_per_token:,.0f} B -> {b.kv_blocks:,} blocks of"
        f" {s.block_size} = {b.kv_tokens:,} tokens"
        f" ({max(0.0, b.kv_gib):.2f} GiB x 2^30 / {per_block:,.0f} B per block)"
    )
    seqs = b.sequences_at(b.max_model_len)
    lines.append(
        f"  at max_model_len {b.max_model_len:,}: {seqs:,} sequence(s) fit"
        f" ({b.sequence_bytes(b.max_model_len) / 2**30:.2f} GiB each);"
        f" max_num_seqs {s.max_num_seqs} x {b.max_model_len:,} would need"
        f" {s.max_num_seqs * b.sequence_bytes(b.max_model_len) / 2**30:,.1f} GiB"
    )
    for issue in b.issues:
        tag = "IMPOSSIBLE" if issue.severe else "note"
        lines.append(f"  {tag} ({issue.kind}): {issue.message}")
    ctx = r.decode_context
    mode = "with CUDA graphs" if s.cuda_graphs else "eager"
    other = "eager" if s.cuda_graphs else "with CUDA graphs"
    batch = max(1, min(s.max_num_seqs, 64))
    lines += [
        "",
        (
            f"speed    prefill {r.speed.prefill_tokens_per_s:,.0f} tok/s per replica;"
            f" decode at {ctx:,} tokens {mode}: {_decode(r.speed, ctx, batch)}"
        ),
        f"         {other}: {_decode(r.other_speed, ctx, batch)}",
    ]
    if r.target is not None:
        t = r.target
        verdict = "MET" if t.met and b.fits else "NOT MET"
        lines += [
            "",
            (
                f"target   {t.target.concurrency} x {t.target.context:,} tokens: {verdict}:"
                f" needs {t.need_gib:.2f} GiB of KV per card, has {t.have_gib:.2f};"
                f" {t.sequences:,} such sequence(s) fit"
            ),
        ]
        for fix in r.suggestions:
            lines.append(
                f"  fix: {fix.setting}={fix.value} -> KV {fix.budget.kv_gib:.2f} GiB,"
                f" {fix.budget.sequences_at(t.target.context):,} sequence(s) fit ({fix.why})"
            )
        if not t.met and not r.suggestions:
            more = (
                "a larger slice or a whole card (it cannot span cards: max_tp 1)"
                if r.budget.card.max_tp < 2
                else "more cards per replica"
            )
            lines.append(f"  no single change fits it: {more} or a smaller target")
    if r.handoffs:
        lines += [
            "",
            (
                f"{'PD hand-off':12} {'prompt':>9} {'cached':>9} {'KV moved':>10}"
                f" {'link':>8} {'transfer':>9} {'saves':>8}  verdict (pd.auto)"
            ),
        ]
        for h in r.handoffs:
            lines.append(
                f"{'':12} {h.prompt_tokens:>9,} {h.cached_tokens:>9,}"
                f" {h.kv_bytes / 1e9:>8.2f}GB {h.link_gbps:>6g}Gb {h.transfer_s:>8.3f}s"
                f" {_seconds(h.benefit_s):>8}  {'split' if h.pays else 'colocated'}: {h.reason}"
            )
    return "\n".join(lines)


def as_dict(r: PlanReport) -> dict[str, Any]:
    b, s = r.budget, r.budget.settings
    return {
        "model": b.model.name,
        "attention": b.model.attention_kind,
        "params": b.model.total_params,
        "active_params": b.model.active_params_per_token,
        "card": b.card.name,
        "tensor_parallel": s.tp,
        "weight_dtype": b.weight_dtype,
        "kv_dtype": s.kv_dtype,
        "max_model_len": b.max_model_len,
        "max_num_seqs": s.max_num_seqs,
        "max_num_batched_tokens": s.max_num_batched_tokens,
        "cuda_graphs": s.cuda_graphs,
        "memory_gib": {
            "card": b.card.memory_gib,
            "usable": b.usable_gib,
            "weights": b.weights_gib,
            "activations": b.activation_gib,
            "cuda_graphs": b.cuda_graph_gib,
            "runtime": b.runtime_gib,
            "kv": b.kv_gib,
        },
        "kv_bytes_per_token": b.kv_bytes_per_token,
        "kv_blocks": b.kv_blocks,
        "kv_tokens": b.kv_tokens,
        "sequences_at_max_model_len": b.sequences_at(b.max_model_len),
        "fits": b.fits,
        "issues": [{"kind": i.kind, "message": i.message, "severe": i.severe} for i in b.issues],
        "speed": {
            "prefill_tokens_per_s": r.speed.prefill_tokens_per_s,
            "decode_context": r.decode_context,
            "decode_tokens_per_s_one_stream": r.speed.decode_tokens_per_s(1, r.decode_context),
            "other_graph_mode_one_stream": r.other_speed.decode_tokens_per_s(1, r.decode_context),
        },
        "target": None
        if r.target is None
        else {
            "context": r.target.target.context,
            "concurrency": r.target.target.concurrency,
            "need_gib": r.target.need_gib,
            "have_gib": r.target.have_gib,
            "sequences": r.target.sequences,
            "met": r.target.met and b.fits,
        },
        "suggestions": [
            {"setting": f.setting, "value": f.value, "kv_gib": f.budget.kv_gib, "why": f.why}
            for f in r.suggestions
        ],
        "handoffs": [
            {
                "prompt_tokens": h.prompt_tokens,
                "cached_tokens": h.cached_tokens,
                "kv_bytes": h.kv_bytes,
                "link_gbps": h.link_gbps,
                "transfer_s": h.transfer_s,
                "benefit_s": h.benefit_s,
                "disaggregate": h.pays,
                "reason": h.reason,
            }
            for h in r.handoffs
        ],
        "ok": r.ok,
    }
