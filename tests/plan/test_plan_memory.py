"""The per-card budget against hand arithmetic: the cases the issue names."""

from __future__ import annotations

import pytest

from gateway.plan.cards import get_card
from gateway.plan.catalogue import get_model
from gateway.plan.fit import Target, check, suggest
from gateway.plan.memory import EngineSettings, budget, capture_sizes

GIB = 2**30
MIB = 2**20


def test_fp4_on_h200_cuda_graphs_take_the_room_of_a_second_long_sequence() -> None:
    model, card = get_model("deepseek-r1"), get_card("h200")
    target = Target(context=131072, concurrency=2)
    kw = {"tp": 4, "weight_dtype": "fp4", "weights_gib": 106.0, "max_model_len": 131072}
    with_graphs = budget(model, card, EngineSettings(**kw))  # type: ignore[arg-type]
    eager = budget(model, card, EngineSettings(cuda_graphs=False, **kw))  # type: ignore[arg-type]

    usable = 140.4 * 0.9  # 126.36 GiB
    # activations of 8192 tokens: 2 bytes x (4 x 7168 hidden + 128/4 heads x (192 + 128))
    # + fused MoE 8 x (3 x 2048/4 + 7168) + 2 x 256 sequences x 129280 vocab x 4 bytes
    acts = 8192 * 2 * (4 * 7168 + 32 * 320) + 8192 * 2 * 8 * (1536 + 7168) + 2 * 256 * 129280 * 4
    assert acts == 2_043_150_336
    # graphs: 51 sizes up to 512; the 512-token activations + 51 x 61 layers x 0.5 MiB
    assert len(capture_sizes(256)) == 51
    graphs = 512 * 2 * 38912 + 512 * 2 * 8 * 8704 + 2 * 512 * 129280 * 4 + 51 * 61 * MIB // 2
    assert with_graphs.activation_gib == pytest.approx(acts / GIB)
    assert with_graphs.cuda_graph_gib == pytest.approx(graphs / GIB)
    kv = usable - 106.0 - acts / GIB - graphs / GIB - 1.0
    assert with_graphs.kv_gib == pytest.approx(kv)  # 15.34 GiB
    assert eager.kv_gib == pytest.approx(kv + graphs / GIB)  # 17.46 GiB
    # one 131072-token sequence: 131072 x 61 x 576 x 2 bytes = 8.58 GiB, two: 17.16 GiB
    need = 2 * 131072 * 70_272 / GIB
    assert check(with_graphs, target).need_gib == pytest.approx(need)
    assert not check(with_graphs, target).met and with_graphs.sequences_at(131072) == 1
    assert check(eager, target).met and eager.sequences_at(131072) == 2
    # The practitioner's case: 106 of 126 usable GiB are weights, and graph capture did not
    # fit; the planner warns of it and offers enforce_eager first, not last.
    fixes = suggest(model, card, with_graphs.settings, target)
    assert fixes[0].setting == "enforce_eager"
    assert fixes[0].budget.sequences_at(131072) == 2
    assert with_graphs.fits  # the placement itself works; fp4 is only dequantised
    assert [i.kind for i in with_graphs.issues] == ["capability", "cuda_graphs"]
    assert not any(i.severe for i in with_graphs.issues)
    assert "weights take 84% of the 126.4 usable GiB" in with_graphs.issues[1].message
    assert not [i for i in eager.issues if i.kind == "cuda_graphs"]


def test_fp8_weights_leave_room_for_cuda_graphs() -> None:
    model, card = get_model("qwen3-235b-a22b-fp8"), get_card("h200")
    b = budget(model, card, EngineSettings(tp=4, max_model_len=32768))
    assert b.weights_gib / b.usable_gib < 0.8
    assert b.fits and not [i for i in b.issues if i.kind == "cuda_graphs"]
    fixes = suggest(model, card, b.settings, Target(context=32768, concurrency=64))
    assert fixes and fixes[0].setting != "enforce_eager"


def test_max_num_batched_tokens_decides_whether_a_long_context_fits() -> None:
    model, card = get_model("llama-3.1-8b"), get_card("l40s")
    big = budget(model, card, EngineSettings(max_num_batched_tokens=131072, max_model_len=131072))
    small = budget(model, card, EngineSettings(max_num_batched_tokens=12288, max_model_len=131072))
    weights = 8.03e9 * 2 / GIB  # 14.96 GiB
    logits = 2 * 256 * 128256 * 4
    # per token: 2 bytes x (4 x 4096 + (2 x 32 + 2 x 8) x 128 + 3 x 14336)
    per_token = 2 * (4 * 4096 + 80 * 128 + 3 * 14336)
    assert big.activation_gib == pytest.approx((131072 * per_token + logits) / GIB)  # 17.24
    assert small.activation_gib == pytest.approx((12288 * per_token + logits) / GIB)  # 1.84
    graphs = (512 * per_token + 2 * 512 * 128256 * 4 + 51 * 32 * MIB // 2) / GIB
    for b in (big, small):
        assert b.weights_gib == pytest.approx(weights)
        assert b.kv_gib == pytest.approx(40.5 - weights - b.activation_gib - graphs - 1.0)
    # a 131072-token sequence needs 131072 x 131072 B = 16 GiB: 5.95 GiB left vs 21.35
    assert big.kv_gib == pytest.approx(5.95, abs=0.01) and not big.fits
    assert big.issues[0].kind == "does_not_fit" and "16.00 GiB" in big.issues[0].message
    assert small.kv_gib == pytest.approx(21.35, abs=0.01) and small.fits
    assert small.kv_blocks == int(small.kv_gib * GIB // (131072 * 16))
    fixes = suggest(model, card, big.settings, Target(131072))
    assert fixes[0].setting == "max_num_batched_tokens" and fixes[0].value == "32768"


def test_block_quantised_weights_cannot_be_split_192_ways() -> None:
    model, card = get_model("qwen3-235b-a22b-fp8"), get_card("h200")
    tp8 = budget(model, card, EngineSettings(tp=8, max_model_len=32768))
    split = [i for i in tp8.issues if i.kind == "tp_split"]
    assert len(split) == 1 and split[0].severe and not tp8.fits
    # 1536 / 8 = 192 = 1 x 128 + 64
    assert "moe_intermediate_size 1536 / tp 8 = 192" in split[0].message
    assert "1 x 128 + 64" in split[0].message
    tp4 = budget(model, card, EngineSettings(tp=4, max_model_len=32768))  # 384 = 3 x 128
    assert not [i for i in tp4.issues if i.kind == "tp_split"]
    ep = budget(model, card, EngineSettings(tp=8, expert_parallel=True, max_model_len=32768))
    assert ep.fits
    # Re-quantised to fp4, the kernels still split in the checkpoint's 128-wide blocks.
    fp4 = budget(model, card, EngineSettings(tp=8, weight_dtype="fp4", max_model_len=32768))
    fp4_split = [i for i in fp4.issues if i.kind == "tp_split"]
    assert len(fp4_split) == 1 and "= 192 per rank" in fp4_split[0].message
    assert "the fp4 weights cannot be split" in fp4_split[0].message
    # The same weights in bf16 have no blocks: tp 8 splits fine.
    bf16 = budget(model, card, EngineSettings(tp=8, weight_dtype="bf16", max_model_len=32768))
    assert not [i for i in bf16.issues if i.kind == "tp_split"]
    odd = budget(get_model("llama-3.1-8b"), card, EngineSettings(tp=3))
    assert any("not divisible by tp 3" in i.message for i in odd.issues)


def test_capability_the_card_lacks() -> None:
    model = get_model("deepseek-v3")
    ascend = budget(model, get_card("ascend-910b"), EngineSettings(tp=16, max_model_len=8192))
    cap = [i for i in ascend.issues if i.kind == "capability"]
    assert cap and cap[0].severe and "fp8" in cap[0].message
    a100 = budget(model, get_card("a100"), EngineSettings(tp=16, max_model_len=8192))
    assert [i.severe for i in a100.issues if i.kind == "capability"] == [False]
    kv8 = budget(get_model("llama-3.1-8b"), get_card("ascend-910b"), EngineSettings(kv_dtype="fp8"))
    assert any("fp8 KV" in i.message for i in kv8.issues)


def test_weights_alone_over_the_card() -> None:
    b = budget(get_model("llama-3.1-70b"), get_card("h100"), EngineSettings(max_model_len=8192))
    assert b.weights_gib == pytest.approx(70.6e9 * 2 / GIB)  # 131.5 GiB on one 79.6 GiB card
    assert b.kv_gib < 0 and b.kv_blocks == 0 and not b.fits
    assert "no room for KV" in b.issues[-1].message
    fixes = suggest(b.model, b.card, b.settings, Target(8192, 16))
    # tp 2: 65.8 GiB of weights leave ~2 GiB, short of 16 x 8192 x 163,840 B = 20 GiB; tp 4
    # leaves ~34 GiB for 16 x 8192 x 81,920 B = 10 GiB.
    assert [f.setting for f in fixes] == ["tensor_parallel_size"] and fixes[0].value == "4"


def test_concurrency_and_max_num_seqs() -> None:
    b = budget(
        get_model("llama-3.1-8b"),
        get_card("h100"),
        EngineSettings(max_num_seqs=8, max_model_len=32768),
    )
    per_seq = 32768 * 131_072
    assert b.sequences_at(32768) == int(b.kv_gib * GIB // per_seq)
    assert b.concurrency_at(32768) == 8 < b.sequences_at(32768)
    # Partial blocks are whole blocks: 17 tokens hold 2 blocks of 16.
    assert b.sequence_bytes(17) == 32 * 131_072


def test_bad_settings_are_refused() -> None:
    from gateway.plan.shapes import ShapeError

    with pytest.raises(ShapeError, match="gpu_memory_utilization"):
        EngineSettings(gpu_memory_utilization=1.5)
    with pytest.raises(ShapeError, match="tensor parallel"):
        EngineSettings(tp=0)
    with pytest.raises(ShapeError, match="kv dtype"):
        EngineSettings(kv_dtype="fp4")
