"""`config.json` reading (gateway.plan.hfconfig): the quantisation formats, layer mixes and
malformed files, each checked against KV bytes worked out by hand from the config's fields
(layers x KV heads x head dim x 2 (K and V) x dtype bytes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from plan_configs import GEMMA_3_27B, GPT_OSS_120B, LLAMA_31_8B, QWEN3_NEXT_80B, write

from gateway.plan.hfconfig import load_config, resolve_model, shape_from_config
from gateway.plan.shapes import DTYPE_BYTES, ModelShape, ShapeError, dtype_bytes


def llama(**changes: Any) -> dict[str, Any]:
    return {**LLAMA_31_8B, **changes}


@pytest.mark.parametrize(
    ("quantization", "dtype"),
    [
        ({"quant_method": "mxfp4"}, "mxfp4"),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "fp4"),
        ({"quant_method": "modelopt", "quant_algo": "FP8"}, "fp8"),
        ({"quant_method": "fp8"}, "fp8"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "int4"),
        ({"quant_method": "awq", "w_bit": 4, "q_group_size": 128}, "int4"),
        ({"quant_method": "bitsandbytes", "bits": 8}, "int8"),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float"}}},
            },
            "fp4",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float"}}},
            },
            "fp8",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int"}}},
            },
            "int4",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "int"}}},
            },
            "int8",
        ),
        ({"quant_method": "something-new"}, "bf16"),
    ],
)
def test_quantisation_formats_set_the_weight_dtype(
    quantization: dict[str, Any], dtype: str
) -> None:
    shape = shape_from_config(llama(quantization_config=quantization))
    assert (shape.weight_dtype, shape.quant_block) == (dtype, 0)
    # Weights shrink by the dtype's width; embeddings (vocab x hidden, twice untied) stay
    # 16-bit; the KV is untouched by the weights' format.
    embed = 128256 * 4096 * 2
    total = shape.total_params
    assert shape.weight_bytes() == pytest.approx(
        (total - embed) * DTYPE_BYTES[dtype] + embed * max(DTYPE_BYTES[dtype], 2.0)
    )
    assert shape.kv_bytes_per_token("bf16") == 32 * 8 * 128 * 2 * 2


def test_block_wise_fp8_keeps_its_block_width() -> None:
    q = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert shape_from_config(llama(quantization_config=q)).quant_block == 128
    q = {"quant_method": "fp8", "weight_block_size": []}
    assert shape_from_config(llama(quantization_config=q)).quant_block == 0


@pytest.mark.parametrize(
    ("fields", "dtype"),
    [
        ({"torch_dtype": "float16"}, "fp16"),
        ({"torch_dtype": "float32"}, "fp32"),
        ({"torch_dtype": None, "dtype": "float16"}, "fp16"),  # transformers 4.56+ writes `dtype`
        ({"torch_dtype": None}, "bf16"),
    ],
)
def test_unquantised_dtype_from_torch_dtype(fields: dict[str, Any], dtype: str) -> None:
    assert shape_from_config(llama(**fields)).weight_dtype == dtype


def test_chunked_attention_layers_take_the_chunk_as_their_window() -> None:
    # Llama 4's layout: three chunked-attention layers per global one, no sliding_window.
    cfg = {
        "hidden_size": 5120,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_hidden_layers": 48,
        "vocab_size": 202048,
        "intermediate_size": 8192,
        "attention_chunk_size": 8192,
        "layer_types": ["chunked_attention"] * 3 + ["full_attention"],
    }
    cfg["layer_types"] = cfg["layer_types"] * 12  # type: ignore[operator]
    shape = shape_from_config(cfg)
    assert (shape.sliding_layers, shape.sliding_window, shape.full_layers) == (36, 8192, 12)
    per_layer = 2 * 8 * 128 * 2
    assert shape.kv_bytes_per_token("bf16") == 12 * per_layer
    # 100,000 tokens: full layers hold all of it, chunked ones one chunk.
    assert shape.kv_bytes_per_sequence(100_000, "bf16") == per_layer * (12 * 100_000 + 36 * 8192)
    assert shape.attention_kind == "gqa + 36 sliding(8192)"


def test_layer_types_name_linear_and_mamba_layers() -> None:
    cfg = llama(
        layer_types=["linear_attention", "mamba", "full_attention", "full_attention"] * 8,
        linear_num_value_heads=8,
        linear_num_key_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=3,
    )
    shape = shape_from_config(cfg)
    assert (shape.linear_layers, shape.sliding_layers, shape.full_layers) == (16, 0, 16)
    # state = (v_heads x k_dim x v_dim + (2 x k_heads x k_dim + v_heads x v_dim) x
    # (kernel - 1)) x 2 bytes = (32,768 + 1,024 x 2) x 2.
    assert shape.linear_state_bytes == (8 * 64 * 64 + (2 * 4 * 64 + 8 * 64) * 2) * 2 == 69632
    # tp 2: KV heads halve, the recurrent state is split over the ranks too.
    assert shape.kv_bytes_per_sequence(1000, "bf16", tp=2) == (
        2 * 4 * 128 * 2 * 16 * 1000 + 16 * 69632 / 2
    )


def test_qwen3_next_every_fourth_layer_is_full_attention() -> None:
    shape = shape_from_config(QWEN3_NEXT_80B)
    assert (shape.linear_layers, shape.full_layers) == (36, 12)
    # Gated DeltaNet: 32 x 128 x 128 state + (2 x 16 x 128 + 32 x 128) x 3 conv, bf16.
    assert shape.linear_state_bytes == (32 * 128 * 128 + 8192 * 3) * 2 == 1_097_728
    assert shape.kv_bytes_per_token("fp8") == 12 * 2 * 2 * 256 * 1
    assert (shape.experts, shape.shared_experts) == (512, 1)  # shared_expert_intermediate_size
    assert shape.kv_bytes_per_sequence(0, "bf16") == 36 * 1_097_728


def test_gemma_and_gpt_oss_by_hand() -> None:
    gemma = shape_from_config(GEMMA_3_27B)
    # 62 layers, every 6th global: 10 full, 52 sliding over 1,024 tokens; 16 KV heads x 128.
    per_layer = 2 * 16 * 128 * 2
    assert gemma.kv_bytes_per_sequence(32768, "bf16") == per_layer * (10 * 32768 + 52 * 1024)
    oss = shape_from_config(GPT_OSS_120B)
    assert oss.kv_bytes_per_token("bf16") == 18 * 2 * 8 * 64 * 2
    # A 100-token sequence is inside the 128-token window: all 36 layers hold all of it.
    assert oss.kv_bytes_per_sequence(100, "bf16") == 36 * 2 * 8 * 64 * 2 * 100


def test_a_boolean_is_not_a_size() -> None:
    # Some configs write `"sliding_window": false`: no window, so no sliding layers.
    shape = shape_from_config(llama(sliding_window=False))
    assert shape.sliding_layers == 0 and shape.full_layers == 32


def test_gpt2_style_names() -> None:
    cfg = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
    shape = shape_from_config(cfg, name="gpt2")
    assert (shape.layers, shape.hidden_size, shape.num_heads, shape.kv_heads) == (12, 768, 12, 12)
    assert shape.head_dim == 64 and shape.attention_kind == "mha"
    assert shape.kv_bytes_per_token("fp32") == 12 * 2 * 12 * 64 * 4


def test_multimodal_text_config_takes_the_top_level_quantisation() -> None:
    cfg = {
        "architectures": ["Mistral3ForConditionalGeneration"],
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
        "torch_dtype": "bfloat16",
        "vocab_size": 131072,
        "text_config": {
            "hidden_size": 5120,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "num_hidden_layers": 40,
            "intermediate_size": 32768,
            "max_position_embeddings": 131072,
        },
    }
    shape = shape_from_config(cfg)
    assert (shape.weight_dtype, shape.quant_block, shape.vocab_size) == ("fp8", 128, 131072)
    assert shape.kv_bytes_per_token("bf16") == 40 * 2 * 8 * 128 * 2


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"hidden_size": 4096, "num_attention_heads": 32}, "needs num_hidden_layers"),
        ({"num_hidden_layers": 2, "num_attention_heads": 0, "hidden_size": 8}, "needs"),
        (llama(vocab_size=0), "vocab_size must be positive"),
        (
            llama(layer_types=["sliding_attention"] * 32, sliding_window=None),
            "sliding layers need a sliding_window",
        ),
    ],
)
def test_unsizable_configs_are_refused_by_field(cfg: dict[str, Any], message: str) -> None:
    with pytest.raises(ShapeError, match=message):
        shape_from_config(cfg, name="broken")


def test_shape_invariants_name_the_field() -> None:
    base: dict[str, Any] = {
        "name": "m",
        "layers": 4,
        "hidden_size": 64,
        "num_heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "vocab_size": 100,
    }
    ModelShape(**base)
    with pytest.raises(ShapeError, match="head_dim must be positive"):
        ModelShape(**{**base, "head_dim": 0})
    with pytest.raises(ShapeError, match="more sliding/linear layers than layers"):
        ModelShape(**{**base, "sliding_layers": 3, "linear_layers": 2, "sliding_window": 8})
    with pytest.raises(ShapeError, match="unknown dtype 'fp3'"):
        ModelShape(**{**base, "weight_dtype": "fp3"})
    # MLA needs no head_dim: its latent is what the KV holds.
    mla = ModelShape(**{**base, "head_dim": 0, "kv_lora_rank": 32, "qk_rope_head_dim": 8})
    assert mla.kv_bytes_per_layer_token("bf16", tp=4) == (32 + 8) * 2
    with pytest.raises(ShapeError, match="known: fp32, bf16"):
        dtype_bytes("e5m2")


def test_kv_heads_are_replicated_when_fewer_than_ranks() -> None:
    shape = shape_from_config(LLAMA_31_8B)  # 8 KV heads
    per_rank = [shape.kv_bytes_per_token("bf16", tp) for tp in (1, 2, 8, 16)]
    assert per_rank == [32 * 2 * h * 128 * 2 for h in (8, 4, 1, 1)]


def test_config_files_and_directories(tmp_path: Path) -> None:
    path = write(tmp_path, "Llama-3.1-8B-Instruct", LLAMA_31_8B)
    by_file, by_dir = load_config(path), load_config(path.parent)
    assert by_file == by_dir and by_file.name == "Llama-3.1-8B-Instruct"
    assert resolve_model(str(path.parent)) == by_file
    assert resolve_model("llama-3.1-8b").kv_bytes_per_token("bf16") == by_file.kv_bytes_per_token(
        "bf16"
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not JSON"),
        ("[1, 2]", "a config.json holds a JSON object"),
        (None, "cannot read"),
    ],
)
def test_bad_config_files_say_what_is_wrong(
    tmp_path: Path, content: str | None, message: str
) -> None:
    path = tmp_path / "m" / "config.json"
    path.parent.mkdir()
    if content is not None:
        path.write_text(content)
    with pytest.raises(ShapeError, match=message):
        load_config(path)
    with pytest.raises(ShapeError, match=message):
        resolve_model(str(path))


def test_an_unknown_name_lists_the_catalogue() -> None:
    with pytest.raises(ShapeError, match=r"llama-3\.1-8b") as info:
        resolve_model("no-such-model-7b")
    assert "no-such-model-7b" in info.value.message
