"""Which settings would fit a target of `concurrency` sequences of `context` tokens.

Each candidate is one changed engine argument (or the card count), re-budgeted with the
same arithmetic; the ones that fit are offered, cheapest first: free changes (a smaller
`max_num_batched_tokens`, a higher `gpu_memory_utilization`, an fp8 KV cache) before more
cards, and CUDA graphs off only as the last resort since eager decode is much slower,
unless the weights fill the card, where capture is what fails first. A card that cannot
span replicas (a MIG slice, `max_tp: 1`) is never offered more tensor parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.plan.cards import Card
from gateway.plan.memory import Budget, EngineSettings, budget
from gateway.plan.shapes import ModelShape, gib

MAX_UTILIZATION = 0.95
MNBT_STEPS = (65536, 32768, 16384, 12288, 8192, 4096, 2048)
TP_STEPS = (1, 2, 4, 8, 16)


@dataclass(frozen=True, slots=True)
class Target:
    context: int
    concurrency: int = 1


@dataclass(frozen=True, slots=True)
class TargetCheck:
    target: Target
    need_gib: float  # KV the target needs per card
    have_gib: float
    sequences: int  # sequences of target.context that fit

    @property
    def met(self) -> bool:
        return self.sequences >= self.target.concurrency


@dataclass(frozen=True, slots=True)
class Suggestion:
    setting: str
    value: str
    budget: Budget
    why: str


def check(b: Budget, target: Target) -> TargetCheck:
    need = gib(b.sequence_bytes(target.context)) * target.concurrency
    return TargetCheck(target, need, max(0.0, b.kv_gib), b.sequences_at(target.context))


def _meets(b: Budget, target: Target) -> bool:
    return b.fits and check(b, target).met


def _target_settings(s: EngineSettings, target: Target) -> EngineSettings:
    # The engine must accept the target's context and run that many sequences at once.
    return s.with_(
        max_model_len=max(target.context, s.max_model_len or 0) if s.max_model_len else None,
        max_num_seqs=max(s.max_num_seqs, target.concurrency),
    )


def suggest(
    model: ModelShape, card: Card, settings: EngineSettings, target: Target
) -> list[Suggestion]:
    """Single changes that make `target` fit, cheapest first; [] if it already fits."""
    base_settings = _target_settings(settings, target)
    base = budget(model, card, base_settings)
    if _meets(base, target):
        return []
    out: list[Suggestion] = []
    need = check(base, target).need_gib
    short = need - max(0.0, base.kv_gib)

    for mnbt in MNBT_STEPS:
        if mnbt >= base_settings.max_num_batched_tokens:
            continue
        b = budget(model, card, base_settings.with_(max_num_batched_tokens=mnbt))
        if _meets(b, target):
            freed = base.activation_gib - b.activation_gib
            out.append(
                Suggestion(
                    "max_num_batched_tokens",
                    str(mnbt),
                    b,
                    f"activations {base.activation_gib:.1f} -> {b.activation_gib:.1f} GiB frees"
                    f" {freed:.1f} GiB for KV (short by {short:.1f} GiB)",
                )
            )
            break
    used = base.weights_gib + base.activation_gib + base.cuda_graph_gib + base.runtime_gib
    util = (used + need) / card.memory_gib
    if settings.gpu_memory_utilization < util <= MAX_UTILIZATION:
        util = min(MAX_UTILIZATION, round(util + 0.005, 2))
        b = budget(model, card, base_settings.with_(gpu_memory_utilization=util))
        if _meets(b, target):
            out.append(
                Suggestion(
                    "gpu_memory_utilization",
                    f"{util:.2f}",
                    b,
                    f"({used:.1f} used + {need:.1f} KV needed) / {card.memory_gib:g} GiB",
                )
            )
    if settings.kv_dtype in ("bf16", "fp16", "fp32") and card.supports("fp8") != "none":
        b = budget(model, card, base_settings.with_(kv_dtype="fp8"))
        if _meets(b, target):
            out.append(
                Suggestion(
                    "kv_cache_dtype",
                    "fp8",
                    b,
                    f"halves KV per token: {base.kv_bytes_per_token:,.0f} ->"
                    f" {b.kv_bytes_per_token:,.0f} bytes per card",
                )
            )
    for tp in TP_STEPS:
        if tp <= settings.tp or tp > card.max_tp:
            continue
        b = budget(model, card, base_settings.with_(tp=tp, weights_gib=_scaled(settings, tp)))
        if _meets(b, target):
            out.append(
                Suggestion(
                    "tensor_parallel_size",
                    str(tp),
                    b,
                    f"weights {base.weights_gib:.1f} -> {b.weights_gib:.1f} GiB per card",
                )
            )
            break
    if settings.cuda_graphs:
        b = budget(model, card, base_settings.with_(cuda_graphs=False))
        if _meets(b, target):
            out.append(
                Suggestion(
                    "enforce_eager",
                    "true",
                    b,
                    f"drops the {base.cuda_graph_gib:.1f} GiB CUDA graph reserve; decode is"
                    " launch-bound without graphs (see the decode estimate)",
                )
            )
    if any(i.kind == "cuda_graphs" for i in base.issues):
        # Weights fill the card: graphs are the first thing to give up, not the last.
        out.sort(key=lambda f: f.setting != "enforce_eager")
    return out


def _scaled(settings: EngineSettings, tp: int) -> float | None:
    if settings.weights_gib is None:
        return None
    return settings.weights_gib * settings.tp / tp
