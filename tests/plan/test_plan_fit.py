"""Targets and the single changes that meet them (gateway.plan.fit), checked over the
catalogue's models and cards: every suggestion's own budget meets the target, changes only
the setting it names, and none is offered when the target already fits."""

from __future__ import annotations

import itertools
import random

import pytest

from gateway.plan.cards import builtin_cards, get_card
from gateway.plan.catalogue import MODELS, get_model
from gateway.plan.fit import MAX_UTILIZATION, Target, check, suggest
from gateway.plan.memory import EngineSettings, budget
from gateway.plan.shapes import ShapeError

FIELDS = {
    "max_num_batched_tokens": "max_num_batched_tokens",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "kv_cache_dtype": "kv_dtype",
    "tensor_parallel_size": "tp",
    "enforce_eager": "cuda_graphs",
}


def cases() -> list[tuple[str, str, int, int]]:
    rng = random.Random(50)
    combos = list(itertools.product(sorted(MODELS), sorted(builtin_cards())))
    return [
        (m, c, rng.choice([4096, 32768, 131072]), rng.choice([1, 8, 64]))
        for m, c in rng.sample(combos, 24)
    ]


@pytest.mark.parametrize(("model", "card", "context", "concurrency"), cases())
def test_every_suggestion_meets_the_target_by_the_one_change_it_names(
    model: str, card: str, context: int, concurrency: int
) -> None:
    shape, gpu = get_model(model), get_card(card)
    settings = EngineSettings(max_num_batched_tokens=16384)
    target = Target(context, concurrency)
    try:
        out = suggest(shape, gpu, settings, target)
    except ShapeError:
        pytest.skip("this card cannot hold this model's dtypes at all")
    assert len({s.setting for s in out}) == len(out)  # one of each kind at most
    for s in out:
        assert s.budget.fits
        assert check(s.budget, target).met
        changed = {
            f
            for f in (
                "max_num_batched_tokens",
                "gpu_memory_utilization",
                "kv_dtype",
                "tp",
                "cuda_graphs",
            )
            if getattr(s.budget.settings, f) != getattr(settings, f)
        }
        assert changed <= {FIELDS[s.setting], "weights_gib"}, (s.setting, changed)
        assert s.why
        if s.setting == "gpu_memory_utilization":
            assert settings.gpu_memory_utilization < float(s.value) <= MAX_UTILIZATION


def test_no_suggestion_when_the_target_already_fits() -> None:
    shape, gpu = get_model("llama-3.1-8b"), get_card("h100")
    settings = EngineSettings()
    b = budget(shape, gpu, settings.with_(max_num_seqs=4))
    target = Target(4096, 2)
    assert check(b, target).met
    assert suggest(shape, gpu, settings, target) == []


def test_the_kv_a_target_needs_scales_with_its_concurrency() -> None:
    b = budget(get_model("qwen3-8b"), get_card("l40s"), EngineSettings())
    one, eight = check(b, Target(8192, 1)), check(b, Target(8192, 8))
    assert eight.need_gib == pytest.approx(8 * one.need_gib)
    assert one.have_gib == eight.have_gib >= 0.0
    assert one.sequences == eight.sequences
    assert one.met is (one.sequences >= 1) and eight.met is (eight.sequences >= 8)
    longer = check(b, Target(32768, 1))
    assert longer.need_gib > one.need_gib and longer.sequences <= one.sequences
