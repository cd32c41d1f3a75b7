"""Read a local Hugging Face `config.json` into a `ModelShape` (no download, no transformers).

Knows the field names of Llama/Qwen/Mistral (GQA), DeepSeek/Kimi (MLA, MoE), Gemma 3
(`sliding_window_pattern`), gpt-oss and newer configs (`layer_types`), Qwen3-Next
(`full_attention_interval`, Gated DeltaNet state) and the common `quantization_config`s.
A multimodal config's `text_config` is what is sized.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gateway.plan.shapes import ModelShape, ShapeError


def _int(cfg: Mapping[str, Any], *names: str, default: int = 0) -> int:
    for name in names:
        value = cfg.get(name)
        if isinstance(value, bool):
            continue
        if isinstance(value, int | float) and value:
            return int(value)
    return default


def _layer_mix(cfg: Mapping[str, Any], layers: int) -> tuple[int, int, int]:
    """(sliding layers, sliding window, linear layers)."""
    window = _int(cfg, "sliding_window")
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        sliding = sum(1 for t in types if "sliding" in str(t) or "chunked" in str(t))
        linear = sum(1 for t in types if "linear" in str(t) or "mamba" in str(t))
        if sliding and not window:
            window = _int(cfg, "attention_chunk_size")
        return sliding, window, linear
    interval = _int(cfg, "full_attention_interval")
    if interval:
        return 0, 0, layers - layers // interval
    if not window or cfg.get("use_sliding_window") is False:
        return 0, 0, 0
    pattern = _int(cfg, "sliding_window_pattern")
    if pattern:  # Gemma 3: every pattern-th layer is global
        return layers - layers // pattern, window, 0
    return layers, window, 0


def _linear_state_bytes(cfg: Mapping[str, Any]) -> int:
    v_heads = _int(cfg, "linear_num_value_heads")
    k_heads = _int(cfg, "linear_num_key_heads")
    k_dim = _int(cfg, "linear_key_head_dim")
    v_dim = _int(cfg, "linear_value_head_dim")
    kernel = _int(cfg, "linear_conv_kernel_dim", default=4)
    if not (v_heads and k_dim and v_dim):
        return 0
    conv_channels = 2 * k_heads * k_dim + v_heads * v_dim
    return (v_heads * k_dim * v_dim + conv_channels * (kernel - 1)) * 2


def _quantisation(cfg: Mapping[str, Any]) -> tuple[str, int]:
    """(weight dtype, block size) from `quantization_config`, else `torch_dtype`."""
    q = cfg.get("quantization_config")
    if isinstance(q, Mapping):
        method = str(q.get("quant_method", "")).lower()
        algo = str(q.get("quant_algo", "")).lower()
        if method == "fp8":
            block = q.get("weight_block_size")
            return "fp8", int(block[-1]) if isinstance(block, list) and block else 0
        if method == "mxfp4":
            return "mxfp4", 0
        if "nvfp4" in algo or "fp4" in method:
            return "fp4", 0
        if "fp8" in algo:
            return "fp8", 0
        bits = _int(q, "bits", "w_bit")
        if method == "compressed-tensors":
            groups = q.get("config_groups") or {}
            for group in groups.values() if isinstance(groups, Mapping) else ():
                weights = group.get("weights") or {}
                bits = _int(weights, "num_bits") or bits
                if bits == 4 and weights.get("type") == "float":
                    return "fp4", 0
                if bits == 8 and weights.get("type") == "float":
                    return "fp8", 0
        if bits == 4:
            return "int4", 0
        if bits == 8:
            return "int8", 0
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return {"float16": "fp16", "float32": "fp32"}.get(dtype, "bf16"), 0


def shape_from_config(cfg: Mapping[str, Any], name: str = "config") -> ModelShape:
    top = cfg
    text = cfg.get("text_config")
    if isinstance(text, Mapping):
        cfg = {
            **text,
            "quantization_config": cfg.get("quantization_config"),
            "torch_dtype": text.get("torch_dtype") or cfg.get("torch_dtype"),
        }
    layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _int(cfg, "hidden_size", "n_embd", "d_model")
    heads = _int(cfg, "num_attention_heads", "n_head")
    if not (layers and hidden and heads):
        raise ShapeError(f"{name}: needs num_hidden_layers, hidden_size and num_attention_heads")
    kv_lora = _int(cfg, "kv_lora_rank")
    rope = _int(cfg, "qk_rope_head_dim")
    nope = _int(cfg, "qk_nope_head_dim")
    head_dim = nope + rope if kv_lora else _int(cfg, "head_dim", default=hidden // heads)
    experts = _int(cfg, "n_routed_experts", "num_experts", "num_local_experts")
    intermediate = _int(cfg, "intermediate_size", "ffn_dim")
    shared = _int(cfg, "n_shared_experts")
    if not shared and _int(cfg, "shared_expert_intermediate_size"):
        shared = 1
    sliding, window, linear = _layer_mix(cfg, layers)
    dtype, block = _quantisation(cfg)
    return ModelShape(
        name=name,
        layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        kv_heads=_int(cfg, "num_key_value_heads", default=heads),
        head_dim=head_dim,
        vocab_size=_int(cfg, "vocab_size", default=_int(top, "vocab_size")),
        intermediate_size=intermediate,
        experts=experts,
        experts_per_token=_int(cfg, "num_experts_per_tok", "experts_per_token") if experts else 0,
        moe_intermediate_size=(_int(cfg, "moe_intermediate_size") or intermediate)
        if experts
        else 0,
        shared_experts=shared,
        dense_layers=_int(cfg, "first_k_dense_replace") if experts else 0,
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=nope,
        v_head_dim=_int(cfg, "v_head_dim"),
        q_lora_rank=_int(cfg, "q_lora_rank"),
        sliding_window=window,
        sliding_layers=sliding,
        linear_layers=linear,
        linear_state_bytes=_linear_state_bytes(cfg),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", top.get("tie_word_embeddings"))),
        max_position=_int(cfg, "max_position_embeddings", "max_sequence_length"),
        weight_dtype=dtype,
        quant_block=block,
    )


def load_config(path: str | Path) -> ModelShape:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        raw = json.loads(p.read_text())
    except OSError as exc:
        raise ShapeError(f"cannot read {p}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ShapeError(f"{p} is not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ShapeError(f"{p}: a config.json holds a JSON object")
    return shape_from_config(raw, name=p.parent.name or p.stem)


def resolve_model(spec: str) -> ModelShape:
    """A catalogue name, or a path to a `config.json` (or the directory holding one)."""
    from gateway.plan.catalogue import get_model

    p = Path(spec)
    if p.suffix == ".json" or p.is_dir() or p.exists():
        return load_config(p)
    return get_model(spec)
