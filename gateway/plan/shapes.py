"""A model's shape: what sizes its weights, its activations and its KV cache.

KV per sequence depends on the attention of each layer:

* full attention (MHA/GQA) keeps a key and a value per KV head per token:
  `2 x kv_heads x head_dim x dtype bytes` per layer per token;
* MLA keeps one compressed latent per token per layer: `(kv_lora_rank + qk_rope_head_dim)
  x dtype bytes`, and that latent is replicated on every tensor-parallel rank;
* sliding-window layers keep at most `sliding_window` tokens;
* linear-attention (recurrent) layers keep a fixed state per sequence, whatever its length.

So a hybrid model's KV grows with context only through its full-attention layers, which is
why a 1M-token context can need hundreds of GB on a dense model and tens on a hybrid one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from gateway.errors import ConfigError

# Bytes per element of a weight or KV dtype, block scales included: NVFP4 carries an FP8
# scale per 16 weights, MXFP4 an 8-bit one per 32, INT4 (GPTQ/AWQ) a 16-bit one per 128.
DTYPE_BYTES: Final[dict[str, float]] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5 + 2 / 128,
    "fp4": 0.5 + 1 / 16,
    "mxfp4": 0.5 + 1 / 32,
}
KV_DTYPES: Final = ("fp32", "bf16", "fp16", "fp8", "int8")
# The compute a weight dtype needs from a card (see cards.Card.supports).
DTYPE_CAPABILITY: Final[dict[str, str]] = {
    "fp32": "bf16",
    "bf16": "bf16",
    "fp16": "bf16",
    "fp8": "fp8",
    "int8": "int8",
    "int4": "int4",
    "fp4": "fp4",
    "mxfp4": "fp4",
}


class ShapeError(ConfigError):
    """A model config that cannot be sized (missing or contradictory fields)."""

    code = "model_shape_invalid"


def dtype_bytes(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        known = ", ".join(DTYPE_BYTES)
        raise ShapeError(f"unknown dtype {dtype!r}; known: {known}") from None


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Enough of a transformer to size it. Counts are of the whole model (not per rank)."""

    name: str
    layers: int
    hidden_size: int
    num_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int = 0
    # Mixture of experts: routed experts, how many a token uses, their width; leading
    # dense layers (DeepSeek's `first_k_dense_replace`) use `intermediate_size`.
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    # MLA (DeepSeek, Kimi): a latent of kv_lora_rank + qk_rope_head_dim per token and layer.
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int = 0
    # Layer mix: the rest of `layers` are full attention.
    sliding_window: int = 0
    sliding_layers: int = 0
    linear_layers: int = 0
    linear_state_bytes: int = 0  # one linear layer's recurrent state, per sequence
    tie_embeddings: bool = False
    max_position: int = 0
    # Published parameter counts win over the estimate from the shape.
    params: float | None = None
    active_params: float | None = None
    weight_dtype: str = "bf16"
    # Block-wise quantisation (DeepSeek-style FP8 128x128): a shard must hold whole blocks.
    quant_block: int = 0

    def __post_init__(self) -> None:
        for field_name in ("layers", "hidden_size", "num_heads", "kv_heads", "vocab_size"):
            if getattr(self, field_name) <= 0:
                raise ShapeError(f"model {self.name!r}: {field_name} must be positive")
        if not self.is_mla and self.head_dim <= 0:
            raise ShapeError(f"model {self.name!r}: head_dim must be positive")
        if self.sliding_layers + self.linear_layers > self.layers:
            raise ShapeError(f"model {self.name!r}: more sliding/linear layers than layers")
        if self.sliding_layers and self.sliding_window <= 0:
            raise ShapeError(f"model {self.name!r}: sliding layers need a sliding_window")
        dtype_bytes(self.weight_dtype)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def full_layers(self) -> int:
        return self.layers - self.sliding_layers - self.linear_layers

    @property
    def attention_kind(self) -> str:
        kinds = ["mla" if self.is_mla else ("gqa" if self.kv_heads < self.num_heads else "mha")]
        if self.sliding_layers:
            kinds.append(f"{self.sliding_layers} sliding({self.sliding_window})")
        if self.linear_layers:
            kinds.append(f"{self.linear_layers} linear")
        return " + ".join(kinds)

    # ---- KV ----------------------------------------------------------------------
    def kv_heads_per_rank(self, tp: int) -> int:
        # vLLM replicates KV heads when there are fewer than ranks.
        return max(1, self.kv_heads // tp)

    def kv_bytes_per_layer_token(self, kv_dtype: str, tp: int = 1) -> float:
        """One token's KV in one attention layer, on one tensor-parallel rank."""
        width = dtype_bytes(kv_dtype)
        if self.is_mla:
            return (self.kv_lora_rank + self.qk_rope_head_dim) * width  # replicated per rank
        return 2 * self.kv_heads_per_rank(tp) * self.head_dim * width

    def kv_bytes_per_token(self, kv_dtype: str, tp: int = 1) -> float:
        """KV bytes one more token of context costs (full-attention layers only)."""
        return self.full_layers * self.kv_bytes_per_layer_token(kv_dtype, tp)

    def kv_bytes_per_sequence(self, context: int, kv_dtype: str, tp: int = 1) -> float:
        """KV (and recurrent state) one sequence of `context` tokens holds on one rank."""
        per_layer = self.kv_bytes_per_layer_token(kv_dtype, tp)
        window = min(context, self.sliding_window) if self.sliding_layers else 0
        state = self.linear_layers * self.linear_state_bytes / tp
        return per_layer * (self.full_layers * context + self.sliding_layers * window) + state

    # ---- parameters --------------------------------------------------------------
    def _attention_params(self) -> float:
        h = self.hidden_size
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (
                h * self.q_lora_rank + self.q_lora_rank * self.num_heads * qk
                if self.q_lora_rank
                else h * self.num_heads * qk
            )
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            up = self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + up + self.num_heads * self.v_head_dim * h
        q = h * self.num_heads * self.head_dim
        return 2 * q + 2 * h * self.kv_heads * self.head_dim

    def estimated_params(self) -> tuple[float, float]:
        """(total, active per token) parameters from the shape alone."""
        h = self.hidden_size
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        attention = self.layers * self._attention_params()
        if not self.is_moe:
            mlp = self.layers * 3 * h * self.intermediate_size
            return embed + attention + mlp, embed + attention + mlp
        moe_layers = self.layers - self.dense_layers
        expert = 3 * h * self.moe_intermediate_size
        dense = self.dense_layers * 3 * h * self.intermediate_size
        routed = moe_layers * self.experts * expert
        shared = moe_layers * self.shared_experts * expert
        router = moe_layers * h * self.experts
        total = embed + attention + dense + routed + shared + router
        active = (
            embed
            + attention
            + dense
            + shared
            + router
            + moe_layers * self.experts_per_token * expert
        )
        return total, active

    @property
    def total_params(self) -> float:
        return self.params if self.params is not None else self.estimated_params()[0]

    @property
    def active_params_per_token(self) -> float:
        if self.active_params is not None:
            return self.active_params
        if self.params is not None and not self.is_moe:
            return self.params
        return self.estimated_params()[1]

    def weight_bytes(self, weight_dtype: str | None = None) -> float:
        """Whole-model weight bytes: embeddings stay 16-bit when the rest is quantised."""
        dtype = weight_dtype or self.weight_dtype
        width = dtype_bytes(dtype)
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)
        embed_width = max(width, 2.0)
        return (self.total_params - embed) * width + embed * embed_width

    # ---- tensor-parallel splits ----------------------------------------------------
    def sharded_dims(self) -> dict[str, int]:
        """The weight dimensions tensor parallelism splits, by config name."""
        dims = {"num_attention_heads": self.num_heads}
        if self.intermediate_size and (not self.is_moe or self.dense_layers):
            dims["intermediate_size"] = self.intermediate_size
        if self.is_moe and self.moe_intermediate_size:
            dims["moe_intermediate_size"] = self.moe_intermediate_size
        return dims


def gib(n_bytes: float) -> float:
    return n_bytes / 2**30
