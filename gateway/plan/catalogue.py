"""Built-in model shapes, from the models' public `config.json` files.

Parameter counts are the published ones (model cards); everything else is the config's.
A name not here can be given as a path to a local `config.json` (see `hfconfig`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from gateway.plan.shapes import ModelShape, ShapeError

# Qwen3-Next's Gated DeltaNet layers: 32 value heads x 128 x 128 state plus a causal-conv
# state of (2 x 16 x 128 + 32 x 128) channels x (kernel 4 - 1), all 16-bit.
_QWEN3_NEXT_STATE = (32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 3) * 2

_MODELS: tuple[ModelShape, ...] = (
    ModelShape(
        name="llama-3.1-8b", layers=32, hidden_size=4096, num_heads=32, kv_heads=8,
        head_dim=128, vocab_size=128256, intermediate_size=14336, max_position=131072,
        params=8.03e9,
    ),
    ModelShape(
        name="llama-3.1-70b", layers=80, hidden_size=8192, num_heads=64, kv_heads=8,
        head_dim=128, vocab_size=128256, intermediate_size=28672, max_position=131072,
        params=70.6e9,
    ),
    ModelShape(
        name="qwen3-8b", layers=36, hidden_size=4096, num_heads=32, kv_heads=8,
        head_dim=128, vocab_size=151936, intermediate_size=12288, max_position=40960,
        params=8.2e9,
    ),
    ModelShape(
        name="qwen3-32b", layers=64, hidden_size=5120, num_heads=64, kv_heads=8,
        head_dim=128, vocab_size=151936, intermediate_size=25600, max_position=40960,
        params=32.8e9,
    ),
    ModelShape(
        name="qwen3-30b-a3b", layers=48, hidden_size=2048, num_heads=32, kv_heads=4,
        head_dim=128, vocab_size=151936, intermediate_size=6144, experts=128,
        experts_per_token=8, moe_intermediate_size=768, max_position=40960,
        params=30.5e9, active_params=3.3e9,
    ),
    ModelShape(
        name="qwen3-235b-a22b", layers=94, hidden_size=4096, num_heads=64, kv_heads=4,
        head_dim=128, vocab_size=151936, intermediate_size=12288, experts=128,
        experts_per_token=8, moe_intermediate_size=1536, max_position=40960,
        params=235e9, active_params=22e9,
    ),
    ModelShape(
        name="qwen3-235b-a22b-fp8", layers=94, hidden_size=4096, num_heads=64, kv_heads=4,
        head_dim=128, vocab_size=151936, intermediate_size=12288, experts=128,
        experts_per_token=8, moe_intermediate_size=1536, max_position=40960,
        params=235e9, active_params=22e9, weight_dtype="fp8", quant_block=128,
    ),
    ModelShape(
        name="qwen3-next-80b-a3b", layers=48, hidden_size=2048, num_heads=16, kv_heads=2,
        head_dim=256, vocab_size=151936, intermediate_size=5120, experts=512,
        experts_per_token=10, moe_intermediate_size=512, shared_experts=1,
        linear_layers=36, linear_state_bytes=_QWEN3_NEXT_STATE, max_position=262144,
        params=80e9, active_params=3e9,
    ),
    ModelShape(
        name="deepseek-v3", layers=61, hidden_size=7168, num_heads=128, kv_heads=128,
        head_dim=192, vocab_size=129280, intermediate_size=18432, experts=256,
        experts_per_token=8, moe_intermediate_size=2048, shared_experts=1, dense_layers=3,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        q_lora_rank=1536, max_position=163840, params=671e9, active_params=37e9,
        weight_dtype="fp8", quant_block=128,
    ),
    ModelShape(
        name="kimi-k2", layers=61, hidden_size=7168, num_heads=64, kv_heads=64,
        head_dim=192, vocab_size=163840, intermediate_size=18432, experts=384,
        experts_per_token=8, moe_intermediate_size=2048, shared_experts=1, dense_layers=1,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        q_lora_rank=1536, max_position=131072, params=1.04e12, active_params=32e9,
        weight_dtype="fp8", quant_block=128,
    ),
    ModelShape(
        name="gemma-3-27b", layers=62, hidden_size=5376, num_heads=32, kv_heads=16,
        head_dim=128, vocab_size=262208, intermediate_size=21504, sliding_window=1024,
        sliding_layers=52, tie_embeddings=True, max_position=131072, params=27.4e9,
    ),
    ModelShape(
        name="gpt-oss-120b", layers=36, hidden_size=2880, num_heads=64, kv_heads=8,
        head_dim=64, vocab_size=201088, intermediate_size=2880, experts=128,
        experts_per_token=4, moe_intermediate_size=2880, sliding_window=128,
        sliding_layers=18, max_position=131072, params=116.8e9, active_params=5.1e9,
        weight_dtype="mxfp4",
    ),
    ModelShape(
        name="gpt-oss-20b", layers=24, hidden_size=2880, num_heads=64, kv_heads=8,
        head_dim=64, vocab_size=201088, intermediate_size=2880, experts=32,
        experts_per_token=4, moe_intermediate_size=2880, sliding_window=128,
        sliding_layers=12, max_position=131072, params=20.9e9, active_params=3.6e9,
        weight_dtype="mxfp4",
    ),
)

MODELS: Mapping[str, ModelShape] = MappingProxyType({m.name: m for m in _MODELS})
# DeepSeek-R1 has V3's architecture.
ALIASES: Mapping[str, str] = MappingProxyType({"deepseek-r1": "deepseek-v3"})


def get_model(name: str) -> ModelShape:
    key = ALIASES.get(name.lower(), name.lower())
    try:
        return MODELS[key]
    except KeyError:
        known = ", ".join(sorted((*MODELS, *ALIASES)))
        raise ShapeError(
            f"unknown model {name!r}: give a path to a config.json or one of: {known}"
        ) from None
