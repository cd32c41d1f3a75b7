"""A Llama 3.1 8B replica's budget worked out by hand from the formulas the planner states
(gateway/plan/memory.py's docstring), then the single changes it offers when a KV target is
starved, each re-checked by hand: gpu_memory_utilization, an fp8 KV cache, more tensor
parallelism, CUDA graphs off first when the weights fill the card."""

from __future__ import annotations

import math

import pytest

from gateway.plan.cards import get_card
from gateway.plan.catalogue import get_model
from gateway.plan.fit import MAX_UTILIZATION, Target, check, suggest
from gateway.plan.memory import EngineSettings, budget, capture_sizes
from gateway.plan.report import as_dict, make_plan, render

GIB = 2**30
LLAMA = get_model("llama-3.1-8b")
H100 = get_card("h100")
# Llama 3.1 8B: 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes.
KV_PER_TOKEN = 32 * 8 * 128 * 2 * 2
CONTEXT = 131072
SEQUENCE_GIB = CONTEXT * KV_PER_TOKEN / GIB  # 16 GiB


def activations(tokens: int, seqs: int, tp: int = 1) -> int:
    """tokens x 2 bytes x (4 x hidden + (2 x 32 q/o + 2 x 8 k/v heads) x 128 / tp)
    + tokens x 2 x 3 x 14336 / tp (dense MLP) + 2 x seqs x vocab x 4 (sampler logits)."""
    return (
        tokens * 2 * (4 * 4096 + (2 * 32 + 2 * 8) * 128 // tp)
        + tokens * 2 * 3 * 14336 // tp
        + 2 * seqs * 128256 * 4
    )


def test_the_default_budget_by_hand() -> None:
    b = budget(LLAMA, H100, EngineSettings(max_model_len=CONTEXT))
    assert b.kv_bytes_per_token == KV_PER_TOKEN == 131_072
    assert b.usable_gib == pytest.approx(H100.memory_gib * 0.9)
    assert b.weights_gib == pytest.approx(8.03e9 * 2 / GIB)  # published params x bf16
    assert b.activation_gib == pytest.approx(activations(8192, 256) / GIB)
    # 51 capture sizes (1, 2, 4, 8..256 by 8, 272..512 by 16): the largest batch's
    # activations plus 0.5 MiB per layer per size.
    assert len(capture_sizes(256)) == 3 + 32 + 16 == 51
    graphs = activations(512, 512) + 51 * 32 * 512 * 1024
    assert b.cuda_graph_gib == pytest.approx(graphs / GIB)
    kv = H100.memory_gib * 0.9 - (8.03e9 * 2 + activations(8192, 256) + graphs) / GIB - 1.0
    assert b.kv_gib == pytest.approx(kv)
    assert b.kv_blocks == math.floor(kv * GIB / (KV_PER_TOKEN * 16))
    assert b.kv_tokens == b.kv_blocks * 16
    assert b.sequences_at(CONTEXT) == int(kv // SEQUENCE_GIB)
    # A context that is not a whole number of blocks is rounded up to one.
    assert b.sequence_bytes(17) == 32 * KV_PER_TOKEN
    assert b.concurrency_at(1024) == 256  # max_num_seqs caps what the KV would hold
    text = render(make_plan(b))
    assert f"KV per token per card 131,072 B -> {b.kv_blocks:,} blocks of 16" in text
    assert f"at max_model_len 131,072: {int(kv // SEQUENCE_GIB)} sequence(s) fit" in text


def test_more_tensor_parallelism_splits_weights_and_kv_heads() -> None:
    b = budget(LLAMA, H100, EngineSettings(tp=2, max_model_len=CONTEXT))
    assert b.weights_gib == pytest.approx(8.03e9 * 2 / 2 / GIB)
    assert b.kv_bytes_per_token == KV_PER_TOKEN / 2  # 4 KV heads per rank
    assert b.activation_gib == pytest.approx(activations(8192, 256, tp=2) / GIB)
    # tp 16: only 8 KV heads, so each rank keeps one (replicated, as vLLM does).
    wide = budget(LLAMA, H100, EngineSettings(tp=16))
    assert wide.kv_bytes_per_token == 32 * 1 * 128 * 2 * 2 and wide.fits
    # tp 12 splits neither the 32 attention heads nor the 8 KV heads.
    odd = budget(LLAMA, H100, EngineSettings(tp=12))
    messages = [i.message for i in odd.issues if i.kind == "tp_split"]
    assert "num_attention_heads 32 is not divisible by tp 12" in messages
    assert "tp 12 is not a multiple of kv heads 8" in messages and not odd.fits


def test_starved_kv_offers_utilisation_fp8_and_tp_with_their_arithmetic() -> None:
    settings = EngineSettings(max_model_len=CONTEXT, gpu_memory_utilization=0.8)
    target = Target(CONTEXT, 3)
    base = budget(LLAMA, H100, settings)
    checked = check(base, target)
    assert checked.need_gib == pytest.approx(3 * SEQUENCE_GIB) == pytest.approx(48.0)
    assert checked.sequences == 2 and not checked.met
    used = base.weights_gib + base.activation_gib + base.cuda_graph_gib + 1.0
    util = round((used + 48.0) / H100.memory_gib + 0.005, 2)
    fixes = {s.setting: s for s in suggest(LLAMA, H100, settings, target)}
    # Smaller batches free under 1.3 GiB and CUDA graphs 1.4: neither closes a gap of
    # 48 - kv GiB, so neither is offered.
    assert 48.0 - base.kv_gib > base.activation_gib and 48.0 - base.kv_gib > base.cuda_graph_gib
    assert list(fixes) == ["gpu_memory_utilization", "kv_cache_dtype", "tensor_parallel_size"]
    assert fixes["gpu_memory_utilization"].value == f"{util:.2f}"
    assert fixes["gpu_memory_utilization"].budget.sequences_at(CONTEXT) >= 3
    assert fixes["kv_cache_dtype"].why == "halves KV per token: 131,072 -> 65,536 bytes per card"
    assert fixes["tensor_parallel_size"].value == "2"
    for fix in fixes.values():
        assert fix.budget.fits and check(fix.budget, target).met


def test_a_target_past_any_utilisation_is_not_offered_one() -> None:
    # Four 128K sequences need 64 GiB of KV: more than 95% of the card leaves.
    settings = EngineSettings(max_model_len=CONTEXT)
    base = budget(LLAMA, H100, settings)
    used = base.weights_gib + base.activation_gib + base.cuda_graph_gib + 1.0
    assert (used + 64.0) / H100.memory_gib > MAX_UTILIZATION
    fixes = [s.setting for s in suggest(LLAMA, H100, settings, Target(CONTEXT, 4))]
    assert fixes == ["kv_cache_dtype", "tensor_parallel_size"]
    # And no fix at all when even eight cards cannot hold it.
    assert suggest(LLAMA, H100, settings, Target(CONTEXT, 400)) == []


def test_a_met_target_needs_no_fix_and_raises_max_model_len() -> None:
    settings = EngineSettings(max_model_len=8192)
    assert suggest(LLAMA, H100, settings, Target(CONTEXT, 1)) == []
    report = make_plan(budget(LLAMA, H100, settings), target=Target(CONTEXT, 1))
    assert report.target is not None and report.target.met and report.ok
    data = as_dict(report)
    assert data["target"]["met"] and data["suggestions"] == []


def test_weights_that_fill_the_card_put_cuda_graphs_off_first() -> None:
    # Llama 3.1 70B in bf16 over two H100s: 70.6e9 x 2 bytes / 2 = 65.7 GiB per card of
    # the 71.6 usable.
    model = get_model("llama-3.1-70b")
    settings = EngineSettings(tp=2, max_model_len=8192)
    base = budget(model, H100, settings)
    assert base.weights_gib == pytest.approx(70.6e9 * 2 / 2 / GIB)
    share = base.weights_gib / base.usable_gib
    assert 0.8 <= share < 1
    (note,) = [i for i in base.issues if i.kind == "cuda_graphs"]
    assert not note.severe and f"weights take {share:.0%}" in note.message
    fixes = suggest(model, H100, settings, Target(8192, 1))
    # Capture is what fails first on such a card: eager leads, the rest keep their order.
    assert [f.setting for f in fixes] == [
        "enforce_eager",
        "max_num_batched_tokens",
        "gpu_memory_utilization",
        "kv_cache_dtype",
        "tensor_parallel_size",
    ]
    assert fixes[0].budget.cuda_graph_gib == 0.0
    assert f"drops the {base.cuda_graph_gib:.1f} GiB CUDA graph reserve" in fixes[0].why
    assert fixes[-1].value == "4"


def test_measured_figures_override_the_estimates() -> None:
    measured = EngineSettings(weights_gib=15.0, activation_gib=2.5, cuda_graph_gib=0.5)
    b = budget(LLAMA, H100, measured)
    assert (b.weights_gib, b.activation_gib, b.cuda_graph_gib) == (15.0, 2.5, 0.5)
    assert b.kv_gib == pytest.approx(H100.memory_gib * 0.9 - 15.0 - 2.5 - 0.5 - 1.0)
    eager = budget(LLAMA, H100, EngineSettings(cuda_graphs=False))
    assert eager.cuda_graph_gib == 0.0
    # Measured weights scale with tp when a fix changes it: 15 GiB over 2 cards.
    fixes = suggest(LLAMA, H100, measured.with_(max_model_len=CONTEXT), Target(CONTEXT, 4))
    (tp2,) = [f for f in fixes if f.setting == "tensor_parallel_size"]
    assert tp2.budget.weights_gib == 7.5


def test_fp8_kv_on_a_card_without_fp8_is_not_offered() -> None:
    ascend = get_card("ascend-910b")
    assert ascend.supports("fp8") == "none"
    b = budget(LLAMA, ascend, EngineSettings(kv_dtype="fp8"))
    assert any("an fp8 KV cache needs fp8 support" in i.message for i in b.issues)
    fixes = suggest(LLAMA, ascend, EngineSettings(max_model_len=CONTEXT), Target(CONTEXT, 4))
    assert fixes and "kv_cache_dtype" not in [f.setting for f in fixes]
    # An A100 dequantises fp8 weights (weight-only) and still keeps an fp8 KV cache.
    assert get_card("a100").supports("fp8") == "weight_only"
    a100 = suggest(
        LLAMA, get_card("a100"), EngineSettings(max_model_len=CONTEXT), Target(CONTEXT, 4)
    )
    assert "kv_cache_dtype" in [f.setting for f in a100]
