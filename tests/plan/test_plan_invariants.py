"""What must hold for every model and card the planner knows, not only the worked cases:
the budget adds up, each engine setting moves it the way the engine would, and the speed
model slows per stream as batches and contexts grow. A catalogue entry or a card that
breaks one of these is a wrong figure an operator would size a fleet on."""

from __future__ import annotations

import pytest

from gateway.plan.cards import builtin_cards, get_card
from gateway.plan.catalogue import MODELS, get_model
from gateway.plan.memory import KV_DTYPES, EngineSettings, budget
from gateway.plan.perf import speed
from gateway.plan.shapes import ShapeError

GIB = 2**30
CARDS = ("a100", "h100", "h200", "b200", "mi300x")


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("card", CARDS)
def test_the_budget_adds_up_and_blocks_fit_in_the_kv(model: str, card: str) -> None:
    b = budget(get_model(model), get_card(card), EngineSettings(tp=8))
    parts = b.weights_gib + b.activation_gib + b.cuda_graph_gib + b.runtime_gib + b.kv_gib
    assert parts == pytest.approx(b.usable_gib)
    assert b.usable_gib == pytest.approx(get_card(card).memory_gib * 0.9)
    if b.kv_gib > 0:
        used = b.kv_blocks * b.settings.block_size * b.kv_bytes_per_token
        assert used <= b.kv_gib * GIB  # whole blocks only, never more than the room
        assert b.kv_gib * GIB - used < b.settings.block_size * b.kv_bytes_per_token
    else:
        assert b.kv_blocks == 0 and not b.fits


@pytest.mark.parametrize("model", sorted(MODELS))
def test_each_setting_moves_the_budget_the_engine_way(model: str) -> None:
    shape, card = get_model(model), get_card("h200")
    base = budget(shape, card, EngineSettings(tp=8))
    # More of the card for the engine: all of it goes to the KV cache.
    more = budget(shape, card, EngineSettings(tp=8, gpu_memory_utilization=0.95))
    assert more.kv_gib - base.kv_gib == pytest.approx(card.memory_gib * 0.05)
    # Eager mode: the CUDA graphs' memory goes to the KV cache.
    eager = budget(shape, card, EngineSettings(tp=8, cuda_graphs=False))
    assert eager.cuda_graph_gib == 0 and eager.kv_gib == pytest.approx(
        base.kv_gib + base.cuda_graph_gib
    )
    # Half the tensor-parallel degree: each card holds twice the weights.
    half = budget(shape, card, EngineSettings(tp=4))
    assert half.weights_gib == pytest.approx(2 * base.weights_gib)
    # An fp8 KV cache stores a token in half the bytes of bf16 (and no more than fp32's).
    fp8 = budget(shape, card, EngineSettings(tp=8, kv_dtype="fp8"))
    assert fp8.kv_bytes_per_token == pytest.approx(base.kv_bytes_per_token / 2)
    assert fp8.kv_gib == pytest.approx(base.kv_gib)
    if base.kv_gib > 0:
        assert fp8.kv_tokens >= 2 * base.kv_tokens - base.settings.block_size


@pytest.mark.parametrize("model", sorted(MODELS))
def test_longer_contexts_fit_fewer_sequences(model: str) -> None:
    b = budget(get_model(model), get_card("b200"), EngineSettings(tp=8))
    counts = [b.sequences_at(context) for context in (1024, 8192, 32768, 131072)]
    assert counts == sorted(counts, reverse=True)
    assert all(b.concurrency_at(c) <= b.settings.max_num_seqs for c in (1024, 131072))


@pytest.mark.parametrize("model", sorted(MODELS))
def test_speed_shares_a_step_between_more_streams(model: str) -> None:
    s = speed(budget(get_model(model), get_card("h100"), EngineSettings(tp=8)))
    assert s.prefill_tokens_per_s > 0 and s.step_overhead_s > 0
    # A larger batch: more tokens per second in all, fewer for each stream.
    total = [s.decode_tokens_per_s(batch, 4096) for batch in (1, 8, 64)]
    assert total == sorted(total)
    per_stream = [t / batch for t, batch in zip(total, (1, 8, 64), strict=True)]
    assert per_stream == sorted(per_stream, reverse=True)
    # A longer context: every step reads more KV, so it takes longer.
    assert s.step_s(8, 131072) > s.step_s(8, 4096)
    # Eager mode adds launch time to every step.
    eager = speed(
        budget(get_model(model), get_card("h100"), EngineSettings(tp=8, cuda_graphs=False))
    )
    assert eager.step_s(1, 1024) > s.step_s(1, 1024)


@pytest.mark.parametrize(
    "bad",
    [
        {"tp": 0},
        {"gpu_memory_utilization": 0.0},
        {"gpu_memory_utilization": 1.1},
        {"max_num_seqs": 0},
        {"block_size": 0},
        {"max_model_len": 0},
        {"kv_dtype": "fp6"},
    ],
)
def test_impossible_settings_are_refused_by_name(bad: dict[str, object]) -> None:
    with pytest.raises(ShapeError):
        EngineSettings(**bad)  # type: ignore[arg-type]


def test_every_known_kv_dtype_sizes_tokens_by_its_width() -> None:
    shape = get_model("llama-3.1-8b")
    per = {d: shape.kv_bytes_per_token(d, 1) for d in KV_DTYPES}
    assert per["fp32"] == 2 * per["bf16"] == 2 * per["fp16"] == 4 * per["fp8"]
    assert per["int8"] == per["fp8"]
    assert set(builtin_cards()) >= set(CARDS)
