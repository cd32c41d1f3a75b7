"""Every built-in model's KV bytes per token worked out by hand from its published
`config.json` fields, the speed roofline of one replica by hand, the link names, and the
report as text and JSON where the worked cases do not look (eager mode, hand-offs, a target
no single change meets)."""

from __future__ import annotations

import math

import pytest

from gateway.plan.cards import get_card
from gateway.plan.catalogue import ALIASES, MODELS, get_model
from gateway.plan.fit import Target
from gateway.plan.handoff import LINKS, link_gbps
from gateway.plan.memory import EngineSettings, budget
from gateway.plan.perf import EAGER_S_PER_LAYER, MBU, MFU, STEP_OVERHEAD_S, sim_profile, speed
from gateway.plan.report import as_dict, make_plan, render
from gateway.plan.shapes import ShapeError

# GQA: full-attention layers x KV heads x head dim x (K, V) x 2 bytes.
# MLA: layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes, one latent per token.
KV_BF16 = {
    "llama-3.1-8b": 32 * 8 * 128 * 2 * 2,
    "llama-3.1-70b": 80 * 8 * 128 * 2 * 2,
    "qwen3-8b": 36 * 8 * 128 * 2 * 2,
    "qwen3-32b": 64 * 8 * 128 * 2 * 2,
    "qwen3-30b-a3b": 48 * 4 * 128 * 2 * 2,
    "qwen3-235b-a22b": 94 * 4 * 128 * 2 * 2,
    "qwen3-235b-a22b-fp8": 94 * 4 * 128 * 2 * 2,
    # 48 layers, every 4th full attention; the other 36 keep a fixed recurrent state.
    "qwen3-next-80b-a3b": 12 * 2 * 256 * 2 * 2,
    "deepseek-v3": 61 * (512 + 64) * 2,
    "kimi-k2": 61 * (512 + 64) * 2,
    # 62 layers, every 6th global: 10 grow with context, 52 keep 1,024 tokens.
    "gemma-3-27b": 10 * 16 * 128 * 2 * 2,
    # Alternating sliding (128) and full layers.
    "gpt-oss-120b": 18 * 8 * 64 * 2 * 2,
    "gpt-oss-20b": 12 * 8 * 64 * 2 * 2,
}
MAX_POSITION = {
    "llama-3.1-8b": 131072,
    "llama-3.1-70b": 131072,
    "qwen3-8b": 40960,
    "qwen3-32b": 40960,
    "qwen3-30b-a3b": 40960,
    "qwen3-235b-a22b": 40960,
    "qwen3-235b-a22b-fp8": 40960,
    "qwen3-next-80b-a3b": 262144,
    "deepseek-v3": 163840,
    "kimi-k2": 131072,
    "gemma-3-27b": 131072,
    "gpt-oss-120b": 131072,
    "gpt-oss-20b": 131072,
}


def test_the_table_covers_the_catalogue() -> None:
    assert set(KV_BF16) == set(MODELS) == set(MAX_POSITION)
    assert get_model("DeepSeek-R1") == get_model("deepseek-v3")  # alias, any case
    assert set(ALIASES) == {"deepseek-r1"}


@pytest.mark.parametrize("name", sorted(KV_BF16))
def test_kv_bytes_per_token_by_hand(name: str) -> None:
    m = get_model(name)
    assert m.kv_bytes_per_token("bf16") == KV_BF16[name]
    assert m.kv_bytes_per_token("fp8") == KV_BF16[name] / 2
    assert m.max_position == MAX_POSITION[name]
    # Over 8 ranks: an MLA latent is kept whole on each; KV heads are split (at least one).
    per_rank = m.kv_bytes_per_token("bf16", tp=8)
    if m.is_mla:
        assert per_rank == KV_BF16[name]
    else:
        assert per_rank == KV_BF16[name] * max(1, m.kv_heads // 8) / m.kv_heads


def test_llama_speed_by_hand() -> None:
    h100 = get_card("h100")
    b = budget(get_model("llama-3.1-8b"), h100, EngineSettings())
    s = speed(b)
    flops = h100.bf16_tflops * 1e12 * MFU
    bandwidth = h100.bandwidth_tbs * 1e12 * MBU
    assert s.prefill_tokens_per_s == pytest.approx(flops / (2 * 8.03e9))
    assert s.decode_base_s == pytest.approx(8.03e9 * 2 / bandwidth)
    assert s.attention_s_per_token == pytest.approx(131_072 / bandwidth)
    assert s.step_overhead_s == STEP_OVERHEAD_S
    one = 1 / (STEP_OVERHEAD_S + s.decode_base_s + 2 * 8.03e9 / flops + 4096 * 131_072 / bandwidth)
    assert s.decode_tokens_per_s(1, 4096) == pytest.approx(one)
    eager = speed(budget(get_model("llama-3.1-8b"), h100, EngineSettings(cuda_graphs=False)))
    assert eager.step_overhead_s == pytest.approx(STEP_OVERHEAD_S + 32 * EAGER_S_PER_LAYER)
    # fp8 weights on a card with fp8 tensor cores: the fp8 peak, and half the bytes to read.
    fp8 = speed(budget(get_model("llama-3.1-8b"), h100, EngineSettings(weight_dtype="fp8")))
    assert fp8.prefill_tokens_per_s == pytest.approx(h100.fp8_tflops * 1e12 * MFU / (2 * 8.03e9))
    assert fp8.decode_base_s == pytest.approx(s.decode_base_s / 2)


def test_a_simulated_engine_carries_the_replicas_kv() -> None:
    gemma = budget(get_model("gemma-3-27b"), get_card("h200"), EngineSettings(max_model_len=32768))
    prof = sim_profile(gemma, name="g", context=8192)
    # A hybrid's KV per token depends on the length: at 8,192 tokens, 10 full layers hold
    # all of them and 52 sliding ones 1,024, averaged over the 8,192.
    per_layer = 16 * 128 * 2 * 2
    per_token = per_layer * (10 * 8192 + 52 * 1024) / 8192
    assert prof.kv_bytes_per_token == int(per_token)
    assert prof.num_gpu_blocks == int(gemma.kv_gib * 2**30 // (per_token * 16))
    assert (prof.block_size, prof.max_model_len, prof.max_num_seqs) == (16, 32768, 256)
    assert prof.link_bytes_per_s == 100e9 / 8


@pytest.mark.parametrize(
    ("spec", "gbps"),
    [("10gbe", 10.0), ("400G-IB", 400.0), ("25g", 25.0), ("40gbps", 40.0), (" 800 ", 800.0)],
)
def test_links_by_name_or_number(spec: str, gbps: float) -> None:
    assert link_gbps(spec) == gbps


@pytest.mark.parametrize(
    ("spec", "message"),
    [("0", "must be positive"), ("inf", "must be positive"), ("carrier pigeon", "unknown link")],
)
def test_bad_links(spec: str, message: str) -> None:
    with pytest.raises(ShapeError, match=message):
        link_gbps(spec)
    assert "10gbe" in LINKS and "nvlink" in LINKS


def test_eager_report_with_handoffs_as_text_and_json() -> None:
    b = budget(
        get_model("llama-3.1-8b"),
        get_card("h100"),
        EngineSettings(cuda_graphs=False, max_model_len=32768),
    )
    report = make_plan(b, prompts=[1000, 60000], link_gbps=link_gbps("100gbe"), cached_tokens=500)
    text = render(report)
    (graphs,) = [line for line in text.splitlines() if "CUDA graphs (off" in line]
    assert graphs.split()[-1] == "0.00"
    assert "decode at 4,096 tokens eager" in text and "with CUDA graphs:" in text
    (header,) = [line for line in text.splitlines() if line.startswith("PD hand-off")]
    assert "verdict (pd.auto)" in header
    data = as_dict(report)
    assert data["cuda_graphs"] is False and data["memory_gib"]["cuda_graphs"] == 0.0
    first, second = data["handoffs"]
    # Llama 8B moves 131,072 bytes of KV per prompt token; 500 were cached already.
    assert (first["prompt_tokens"], first["cached_tokens"]) == (1000, 500)
    assert first["kv_bytes"] == 1000 * 131_072 and second["kv_bytes"] == 60000 * 131_072
    assert second["transfer_s"] > first["transfer_s"] > 0
    # The other graph mode is the faster one here: graphs on.
    assert (
        data["speed"]["other_graph_mode_one_stream"]
        > data["speed"]["decode_tokens_per_s_one_stream"]
    )


def test_a_target_no_single_change_meets() -> None:
    b = budget(get_model("llama-3.1-70b"), get_card("l40s"), EngineSettings(max_model_len=131072))
    report = make_plan(b, target=Target(131072, 64))
    assert not report.ok and report.suggestions == ()
    text = render(report)
    assert "target   64 x 131,072 tokens: NOT MET" in text
    assert "no single change fits it: more cards per replica or a smaller target" in text
    assert math.isclose(
        as_dict(report)["target"]["need_gib"], 64 * 131072 * 327_680 / 2**30, rel_tol=1e-9
    )
