"""KV bytes and parameter counts against hand-computed values from public configs."""

from __future__ import annotations

from pathlib import Path

import pytest
from plan_configs import (
    DEEPSEEK_V3,
    GEMMA_3_27B,
    GPT_OSS_120B,
    LLAMA_31_8B,
    QWEN3_NEXT_80B,
    QWEN25_7B,
    write,
)

from gateway.plan.catalogue import MODELS, get_model
from gateway.plan.hfconfig import load_config, resolve_model, shape_from_config
from gateway.plan.shapes import ShapeError


def test_dense_gqa_llama_kv_and_params() -> None:
    m = shape_from_config(LLAMA_31_8B, "llama")
    # 2 (K and V) x 32 layers x 8 KV heads x 128 dims x 2 bytes
    assert m.kv_bytes_per_token("bf16") == 2 * 32 * 8 * 128 * 2 == 131_072
    assert m.kv_bytes_per_token("fp8") == 65_536
    # Tensor parallel 4 splits the 8 KV heads 2 per rank; at 16 ranks each keeps a copy of 1.
    assert m.kv_bytes_per_token("bf16", tp=4) == 32_768
    assert m.kv_bytes_per_token("bf16", tp=16) == 2 * 32 * 1 * 128 * 2
    embed = 2 * 128256 * 4096
    attention = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024)
    mlp = 32 * 3 * 4096 * 14336
    assert m.estimated_params() == (embed + attention + mlp, embed + attention + mlp)
    assert embed + attention + mlp == 8_029_995_008  # the model card's 8.03B
    assert m.weight_dtype == "bf16" and m.max_position == 131072


def test_mla_deepseek_one_latent_per_layer_replicated_over_tp() -> None:
    m = shape_from_config(DEEPSEEK_V3, "dsv3")
    assert m.is_mla and m.head_dim == 192
    # 61 layers x (512 latent + 64 rope) x 2 bytes; MHA with 128 heads would be 2 x 128 x 192
    assert m.kv_bytes_per_token("bf16") == 61 * 576 * 2 == 70_272
    assert m.kv_bytes_per_token("bf16", tp=8) == 70_272
    assert m.kv_bytes_per_token("fp8") == 35_136
    total, active = m.estimated_params()
    assert total == pytest.approx(671e9, rel=0.002)
    assert active == pytest.approx(37.6e9, rel=0.01)
    assert (m.weight_dtype, m.quant_block) == ("fp8", 128)
    assert m.dense_layers == 3 and m.experts == 256 and m.shared_experts == 1


def test_hybrid_sliding_gemma_keeps_window_in_five_of_six_layers() -> None:
    m = shape_from_config(GEMMA_3_27B, "gemma")
    assert (m.sliding_layers, m.full_layers, m.sliding_window) == (52, 10, 1024)
    per_layer = 2 * 16 * 128 * 2
    assert m.kv_bytes_per_sequence(512, "bf16") == 62 * per_layer * 512
    assert (
        m.kv_bytes_per_sequence(1_000_000, "bf16")
        == (10 * per_layer * 1_000_000 + 52 * per_layer * 1024)
        == 82_356_207_616
    )


def test_layer_types_and_mxfp4_gpt_oss() -> None:
    m = shape_from_config(GPT_OSS_120B, "gpt-oss")
    assert (m.sliding_layers, m.full_layers, m.sliding_window) == (18, 18, 128)
    assert m.weight_dtype == "mxfp4" and m.experts == 128 and m.moe_intermediate_size == 2880
    assert m.estimated_params()[0] == pytest.approx(116.8e9, rel=0.01)


def test_linear_attention_state_is_per_sequence() -> None:
    m = shape_from_config(QWEN3_NEXT_80B, "next")
    assert (m.linear_layers, m.full_layers) == (36, 12)
    state = (32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 3) * 2
    assert m.linear_state_bytes == state == 1_097_728
    assert (
        m.kv_bytes_per_sequence(1_000_000, "bf16") == 12 * 2 * 2 * 256 * 2 * 1_000_000 + 36 * state
    )


def test_one_million_tokens_dense_versus_hybrid() -> None:
    dense = get_model("llama-3.1-70b")
    hybrid = get_model("qwen3-next-80b-a3b")
    # 80 layers x 2 x 8 heads x 128 x 2 bytes = 327,680 B a token: 327.7 GB for 1M tokens
    assert dense.kv_bytes_per_sequence(1_000_000, "bf16") == 327_680_000_000
    # 12 full layers x 2 x 2 heads x 256 x 1 byte (fp8 KV) = 12,288 B a token, plus the state
    sparse = hybrid.kv_bytes_per_sequence(1_000_000, "fp8")
    assert sparse == 12_288_000_000 + 36 * 1_097_728
    assert dense.kv_bytes_per_sequence(1_000_000, "bf16") / sparse > 26


def test_unused_sliding_window_is_ignored() -> None:
    m = shape_from_config(QWEN25_7B, "qwen2.5")
    assert m.sliding_layers == 0 and m.full_layers == 28


def test_catalogue_estimates_agree_with_published_counts() -> None:
    for m in MODELS.values():
        assert m.estimated_params()[0] == pytest.approx(m.total_params, rel=0.02), m.name


def test_config_paths_and_errors(tmp_path: Path) -> None:
    path = write(tmp_path, "Llama-3.1-8B", LLAMA_31_8B)
    assert load_config(path).name == "Llama-3.1-8B"
    assert resolve_model(str(path.parent)).kv_bytes_per_token("bf16") == 131_072
    assert resolve_model("DeepSeek-R1").name == "deepseek-v3"
    with pytest.raises(ShapeError, match=r"unknown model 'nope'.*llama-3\.1-8b"):
        resolve_model("nope")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ShapeError, match="not JSON"):
        load_config(bad)
    with pytest.raises(ShapeError, match="num_hidden_layers"):
        shape_from_config({"hidden_size": 8}, "x")
    with pytest.raises(ShapeError, match="cannot read"):
        load_config(tmp_path / "missing.json")
