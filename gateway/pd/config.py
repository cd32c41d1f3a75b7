"""`pd:` settings: when to split a request into a prefill leg and a decode leg, and how.

Per model: how many bytes of KV one prompt token costs (given, or derived from the attention
shape), how fast the link between the prefill and decode pools is, the mode, and the two
knobs of the `auto` decision. Per pool: which hand-off protocol its engines speak.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.types import ReplicaState, Role

DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's default disaggregation bootstrap port
ANY_MODEL = "*"

_DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "fp16": 2.0,
    "bf16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "fp4": 0.5,
}


class PDMode(str, Enum):
    NEVER = "never"
    ALWAYS = "always"
    AUTO = "auto"


class PDProtocol(str, Enum):
    VLLM = "vllm"  # kv_transfer_params relay, prefill then decode
    SGLANG = "sglang"  # bootstrap room, both legs at once
    VLLM_MOONCAKE = "vllm-mooncake"  # router-minted transfer_id, decode pulls from bootstrap


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class AttentionShape(_Frozen):
    """Enough of a model's attention to size its KV cache per token.

    `dense` (MHA/GQA) keeps a key and a value per KV head per layer; `mla` keeps one
    compressed latent vector per layer. Hybrid and sliding-window models keep full-length KV
    only in some layers: give those as `kv_layers`.
    """

    kind: Literal["dense", "mla"] = "dense"
    layers: int = Field(gt=0)
    kv_heads: int = Field(1, gt=0, description="KV heads (dense only)")
    head_dim: int = Field(gt=0, description="head size (dense) or latent width (mla)")
    dtype: Literal["fp32", "fp16", "bf16", "fp8", "int8", "fp4"] = "bf16"
    kv_layers: int | None = Field(None, gt=0, description="layers holding full-length KV")

    @model_validator(mode="after")
    def _kv_layers_fit(self) -> AttentionShape:
        if self.kv_layers is not None and self.kv_layers > self.layers:
            raise ValueError("kv_layers cannot exceed layers")
        return self

    def kv_bytes_per_token(self) -> int:
        layers = self.kv_layers if self.kv_layers is not None else self.layers
        per_layer = self.head_dim if self.kind == "mla" else 2 * self.kv_heads * self.head_dim
        return max(1, int(layers * per_layer * _DTYPE_BYTES[self.dtype]))


class ModelPDSettings(_Frozen):
    """`pd.models.<model>` (or `pd.models."*"`): whether and when to disaggregate."""

    mode: PDMode = PDMode.NEVER
    kv_bytes_per_token: int | None = Field(None, gt=0, description="overrides `attention`")
    attention: AttentionShape | None = None
    link_gbps: float = Field(100.0, gt=0, description="prefill->decode link, gigabit/s")
    link_latency_ms: float = Field(1.0, ge=0, description="fixed cost of one hand-off")
    min_uncached_tokens: int = Field(
        2048, ge=0, description="auto: disaggregate only above this many uncached tokens"
    )
    max_transfer_ms: float = Field(
        50.0, gt=0, description="auto: disaggregate only if the KV moves within this"
    )
    max_prefill_queue: int = Field(
        2,
        ge=1,
        description="auto: stay colocated while every prefill replica has this many "
        "requests in flight (a queued prefill would cost more TTFT than it saves)",
    )
    prefill_timeout_s: float = Field(
        60.0, gt=0, description="prefill leg budget; past it the request is served colocated"
    )
    first_token_timeout_s: float = Field(
        30.0, gt=0, description="streaming decode leg: wait this long for its first byte"
    )
    decode_attempts: int = Field(2, ge=1, description="decode replicas tried (vllm protocol)")

    @model_validator(mode="after")
    def _sized_when_enabled(self) -> ModelPDSettings:
        if self.mode is not PDMode.NEVER and self.bytes_per_token() is None:
            raise ValueError("set kv_bytes_per_token or attention when mode is not 'never'")
        return self

    def bytes_per_token(self) -> int | None:
        if self.kv_bytes_per_token is not None:
            return self.kv_bytes_per_token
        return self.attention.kv_bytes_per_token() if self.attention is not None else None

    def transfer_seconds(self, tokens: int) -> float:
        """Estimated time to move `tokens` tokens of KV over the link."""
        per_token = self.bytes_per_token() or 0
        return self.link_latency_ms / 1000.0 + tokens * per_token * 8 / (self.link_gbps * 1e9)


class PoolPDSettings(_Frozen):
    """`pd.pools.<pool>`: the hand-off protocol this pool's engines speak."""

    protocol: PDProtocol = PDProtocol.VLLM
    bootstrap_port: int = Field(DEFAULT_BOOTSTRAP_PORT, gt=0, lt=65536)


class PDSettings(_Frozen):
    """`pd:` section. Empty `models` means PD is off and nothing is built for it."""

    models: dict[str, ModelPDSettings] = Field(default_factory=dict)
    pools: dict[str, PoolPDSettings] = Field(
        default_factory=dict, description="protocol per pool; unlisted pools use `default`"
    )
    default: PoolPDSettings = Field(default_factory=PoolPDSettings)
    bootstrap_ports: dict[str, int] = Field(
        default_factory=dict, description="per-replica bootstrap port overrides (sglang)"
    )
    decode_policy: str = Field(
        "least_load", description="policy ranking decode replicas (prefill uses the router)"
    )
    engine_ids: dict[str, str] = Field(
        default_factory=dict,
        description="vllm-mooncake: the kv_transfer_config engine_id of each prefill replica "
        "(by replica id); unlisted, the replica id is sent, so name the engine after it",
    )
    seed: int | None = Field(None, description="seed of the bootstrap-room generator (tests)")
    allow_client_fields: bool = Field(
        False,
        description="forward a client's own engine-steering fields (kv_transfer_params, "
        "ec_transfer_params, bootstrap_host/_port/_room, bootstrap_pair_key, routed_dp_rank, "
        "data_parallel_rank, disagg_prefill_dp_rank, header X-data-parallel-rank: a client "
        "doing its own PD); off, they are stripped, since they make an engine connect where "
        "the client says or pin its DP rank",
    )

    def for_model(self, model: str) -> ModelPDSettings | None:
        found = self.models.get(model)
        return found if found is not None else self.models.get(ANY_MODEL)

    def for_pool(self, pool: str | None) -> PoolPDSettings:
        if pool is None:
            return self.default
        return self.pools.get(pool, self.default)

    def serves_whole(self, replica: ReplicaState) -> bool:
        """May this replica serve a request on its own (prefill and decode)?

        Colocated replicas do; so do decode replicas of vLLM pools (an engine with a KV
        connector still prefills locally when no remote KV is offered), which lets a session
        whose KV already sits on a decoder continue there. Prefill replicas never do, so
        long prefills stay off the decode batches; SGLang decode servers cannot.
        """
        if replica.role is Role.BOTH:
            return True
        return replica.role is Role.DECODE and self.for_pool(replica.pool).protocol in (
            PDProtocol.VLLM,
            PDProtocol.VLLM_MOONCAKE,
        )

    def bootstrap_port(self, replica: str, pool: str | None) -> int:
        return self.bootstrap_ports.get(replica, self.for_pool(pool).bootstrap_port)

    @property
    def enabled(self) -> bool:
        return any(m.mode is not PDMode.NEVER for m in self.models.values())
