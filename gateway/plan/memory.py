"""Per-card memory budget, as vLLM splits it: weights + activations + CUDA graphs + KV.

vLLM takes `gpu_memory_utilization` of the card's memory, loads the weights, runs one
forward pass of `max_num_batched_tokens` tokens to measure the activation peak, keeps room
for CUDA graphs and non-torch allocations, and gives the rest to the KV cache. The planner
estimates each term (vLLM logs the measured ones at start-up; pass those to override):

* activations(T) = T x 2 bytes x (4 x hidden  + attention q/k/v/o width per rank
  + the larger of: dense MLP 3 x intermediate per rank, or fused-MoE
  top_k x (3 x moe_intermediate per rank + hidden) over at most 32768 tokens at a time)
  + sampler logits, 2 x max_num_seqs x vocab x 4 bytes;
* CUDA graphs = the activations of the largest captured batch + 0.5 MiB per layer per
  captured size (vLLM captures 1, 2, 4, 8..256 by 8, then by 16 up to
  min(2 x max_num_seqs, 512));
* runtime = 1 GiB per card (CUDA context, NCCL buffers).

Everything is per card: weights and KV heads are split over the tensor-parallel ranks (an
MLA latent is not: each rank keeps a full copy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Final

from gateway.plan.cards import Card
from gateway.plan.shapes import DTYPE_CAPABILITY, KV_DTYPES, ModelShape, ShapeError, gib

ACTIVATION_BYTES: Final = 2  # bf16 activations whatever the weight dtype
HIDDEN_BUFFERS: Final = 4  # residual, normed input, attention output, MLP output
MOE_CHUNK_TOKENS: Final = 32768  # vLLM's VLLM_FUSED_MOE_CHUNK_SIZE default
GRAPH_BYTES_PER_LAYER: Final = 512 * 1024
RUNTIME_GIB: Final = 1.0
MAX_CAPTURE_SIZE: Final = 512
# Weights past this share of the usable memory leave CUDA graph capture too little room to
# count on (a practitioner's FP4 model at 106 of 126 usable GiB had to run eager).
GRAPHS_TIGHT_SHARE: Final = 0.8
UNQUANTISED: Final = frozenset({"bf16", "fp16", "fp32"})


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """The vLLM engine arguments that decide the budget (SGLang's names in brackets:
    mem_fraction_static, context_length, max_running_requests, chunked_prefill_size)."""

    tp: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    cuda_graphs: bool = True
    kv_dtype: str = "bf16"
    weight_dtype: str | None = None  # None: the model's
    block_size: int = 16
    expert_parallel: bool = False
    # Measured figures (vLLM's start-up log) override the estimates, per card, GiB.
    weights_gib: float | None = None
    activation_gib: float | None = None
    cuda_graph_gib: float | None = None
    runtime_gib: float = RUNTIME_GIB

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ShapeError("tensor parallel degree must be at least 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ShapeError("gpu_memory_utilization must be in (0, 1]")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.block_size < 1:
            raise ShapeError("max_num_seqs, max_num_batched_tokens, block_size must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ShapeError("max_model_len must be at least 1")
        if self.kv_dtype not in KV_DTYPES:
            raise ShapeError(f"kv dtype {self.kv_dtype!r}; known: {', '.join(KV_DTYPES)}")

    def with_(self, **changes: object) -> EngineSettings:
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Issue:
    """Why a placement cannot work (`severe`) or what it costs (`warning`)."""

    kind: str  # does_not_fit | tp_split | capability | warning
    message: str
    severe: bool = True


@dataclass(frozen=True, slots=True)
class Budget:
    """One card of one replica. GiB, except the token and sequence counts."""

    model: ModelShape
    card: Card
    settings: EngineSettings
    weight_dtype: str
    max_model_len: int
    usable_gib: float
    weights_gib: float
    activation_gib: float
    cuda_graph_gib: float
    runtime_gib: float
    kv_gib: float
    kv_bytes_per_token: float
    kv_blocks: int
    issues: tuple[Issue, ...] = field(default_factory=tuple)

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.settings.block_size

    @property
    def fits(self) -> bool:
        return not any(i.severe for i in self.issues)

    def sequence_bytes(self, context: int) -> float:
        bs = self.settings.block_size
        return self.model.kv_bytes_per_sequence(
            -(-context // bs) * bs, self.settings.kv_dtype, self.settings.tp
        )

    def sequences_at(self, context: int) -> int:
        """Sequences of `context` tokens the KV holds at once (no prefix sharing)."""
        per = self.sequence_bytes(context)
        if self.kv_gib <= 0 or per <= 0:
            return 0
        return int(self.kv_gib * 2**30 // per)

    def concurrency_at(self, context: int) -> int:
        return min(self.sequences_at(context), self.settings.max_num_seqs)


def activation_bytes(
    model: ModelShape, tokens: int, max_num_seqs: int, tp: int, expert_parallel: bool = False
) -> float:
    a = ACTIVATION_BYTES
    h = model.hidden_size
    if model.is_mla:
        attn = model.num_heads * (model.head_dim + model.v_head_dim) / tp
    else:
        attn = (2 * model.num_heads + 2 * model.kv_heads) * model.head_dim / tp
    dense = 3 * model.intermediate_size / tp if (not model.is_moe or model.dense_layers) else 0
    mlp = tokens * a * dense
    if model.is_moe:
        width = model.moe_intermediate_size / (1 if expert_parallel else tp)
        moe_tokens = min(tokens, MOE_CHUNK_TOKENS)
        mlp = max(mlp, moe_tokens * a * model.experts_per_token * (3 * width + h))
    logits = 2 * max_num_seqs * model.vocab_size * 4
    return tokens * a * (HIDDEN_BUFFERS * h + attn) + mlp + logits


def capture_sizes(max_num_seqs: int) -> list[int]:
    top = min(2 * max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [1, 2, 4, *range(8, 256 + 1, 8), *range(272, MAX_CAPTURE_SIZE + 1, 16)]
    return [s for s in sizes if s <= top]


def cuda_graph_bytes(model: ModelShape, settings: EngineSettings) -> float:
    sizes = capture_sizes(settings.max_num_seqs)
    largest = activation_bytes(model, sizes[-1], sizes[-1], settings.tp, settings.expert_parallel)
    return largest + len(sizes) * model.layers * GRAPH_BYTES_PER_LAYER


def split_issues(
    model: ModelShape, tp: int, weight_dtype: str, expert_parallel: bool = False
) -> list[Issue]:
    """Tensor-parallel splits that cannot be made: not divisible, or not in whole blocks."""
    issues: list[Issue] = []
    # Quantised kernels keep the checkpoint's block-wide scale tiles whatever the format
    # (an fp8 model re-quantised to fp4 still splits in 128-wide blocks); 16-bit has none.
    block = model.quant_block if weight_dtype not in UNQUANTISED else 0
    for name, dim in model.sharded_dims().items():
        if expert_parallel and name == "moe_intermediate_size":
            continue  # experts are placed whole, never cut
        if dim % tp:
            issues.append(Issue("tp_split", f"{name} {dim} is not divisible by tp {tp}"))
            continue
        shard = dim // tp
        if block and name != "num_attention_heads" and shard % block:
            issues.append(
                Issue(
                    "tp_split",
                    f"{name} {dim} / tp {tp} = {shard} per rank, not a multiple of the"
                    f" {block}-wide quantisation block ({shard} = {shard // block} x {block}"
                    f" + {shard % block}): the {weight_dtype} weights cannot be split this way",
                )
            )
    if model.kv_heads < tp and tp % model.kv_heads and not model.is_mla:
        issues.append(Issue("tp_split", f"tp {tp} is not a multiple of kv heads {model.kv_heads}"))
    return issues


def card_issues(card: Card, tp: int) -> list[Issue]:
    if tp <= card.max_tp:
        return []
    why = f" ({card.note})" if card.note else ""
    return [
        Issue(
            "tp_split",
            f"{card.name}{why} runs at most tp {card.max_tp}: a replica cannot span {tp} of them",
        )
    ]


def graph_issues(b: Budget) -> list[Issue]:
    """CUDA graphs where the weights leave little room: where engines fail at capture."""
    if not b.settings.cuda_graphs or b.usable_gib <= 0:
        return []
    share = b.weights_gib / b.usable_gib
    if not GRAPHS_TIGHT_SHARE <= share < 1:
        return []  # room enough, or the weights alone do not fit (said as such)
    return [
        Issue(
            "cuda_graphs",
            f"weights take {share:.0%} of the {b.usable_gib:.1f} usable GiB: CUDA graph capture"
            f" (estimated {b.cuda_graph_gib:.1f} GiB here, a coarse figure that grows with the"
            " capture sizes and the MoE kernels' workspaces) has little room; expect to run"
            " enforce_eager (decode launch-bound, slower) unless a test start captures",
            severe=False,
        )
    ]


def capability_issues(card: Card, weight_dtype: str, kv_dtype: str) -> list[Issue]:
    issues: list[Issue] = []
    need = DTYPE_CAPABILITY.get(weight_dtype, "bf16")
    support = card.supports(need)
    if support == "none":
        issues.append(
            Issue(
                "capability", f"{weight_dtype} weights need {need} support, which {card.name} lacks"
            )
        )
    elif support == "weight_only":
        issues.append(
            Issue(
                "capability",
                f"{card.name} has no {need} tensor cores: {weight_dtype} weights are dequantised"
                f" per matmul (memory saved, compute at the bf16 rate)",
                severe=False,
            )
        )
    if kv_dtype == "fp8" and card.supports("fp8") == "none":
        issues.append(
            Issue("capability", f"an fp8 KV cache needs fp8 support; {card.name} lacks it")
        )
    return issues


def budget(model: ModelShape, card: Card, settings: EngineSettings) -> Budget:
    """The per-card budget of one replica of `settings.tp` cards, with what stops it."""
    s = settings
    wdtype = s.weight_dtype or model.weight_dtype
    mml = s.max_model_len or model.max_position or 8192
    usable = card.memory_gib * s.gpu_memory_utilization
    weights = s.weights_gib if s.weights_gib is not None else gib(model.weight_bytes(wdtype) / s.tp)
    acts = (
        s.activation_gib
        if s.activation_gib is not None
        else gib(
            activation_bytes(
                model, s.max_num_batched_tokens, s.max_num_seqs, s.tp, s.expert_parallel
            )
        )
    )
    graphs = 0.0
    if s.cuda_graphs:
        graphs = (
            s.cuda_graph_gib if s.cuda_graph_gib is not None else gib(cuda_graph_bytes(model, s))
        )
    kv = usable - weights - acts - graphs - s.runtime_gib
    per_token = model.kv_bytes_per_token(s.kv_dtype, s.tp)
    blocks = max(0, math.floor(kv * 2**30 / (per_token * s.block_size))) if per_token else 0
    issues = capability_issues(card, wdtype, s.kv_dtype)
    issues += split_issues(model, s.tp, wdtype, s.expert_parallel)
    issues += card_issues(card, s.tp)
    result = Budget(
        model,
        card,
        s,
        wdtype,
        mml,
        usable,
        weights,
        acts,
        graphs,
        s.runtime_gib,
        kv,
        per_token,
        blocks,
    )
    issues += fit_issues(result)
    issues += graph_issues(result)
    return replace(result, issues=tuple(issues))


def fit_issues(b: Budget) -> list[Issue]:
    s = b.settings
    used = b.weights_gib + b.activation_gib + b.cuda_graph_gib + b.runtime_gib
    if b.kv_gib <= 0:
        return [
            Issue(
                "does_not_fit",
                f"weights {b.weights_gib:.1f} + activations {b.activation_gib:.1f} + CUDA graphs"
                f" {b.cuda_graph_gib:.1f} + runtime {b.runtime_gib:.1f} = {used:.1f} GiB, over the"
                f" {b.usable_gib:.1f} GiB that gpu_memory_utilization {s.gpu_memory_utilization:g}"
                f" leaves of {b.card.memory_gib:g} GiB: no room for KV",
            )
        ]
    need = gib(b.sequence_bytes(b.max_model_len))
    if need > b.kv_gib:
        return [
            Issue(
                "does_not_fit",
                f"one max_model_len {b.max_model_len:,} sequence needs {need:.2f} GiB of KV, only"
                f" {b.kv_gib:.2f} GiB are left ({b.usable_gib:.1f} usable - {used:.1f} for weights,"
                f" activations, CUDA graphs, runtime)",
            )
        ]
    return []
