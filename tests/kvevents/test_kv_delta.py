"""`IndexDelta`: a loop-side index fed only the deltas of the intake process's whole index
answers every lookup as the whole one does."""

from __future__ import annotations

import random

import pytest

from gateway.kvevents.delta import apply_tracked
from gateway.kvevents.index import EventIndex
from gateway.kvevents.tokenkeys import chain_keys, root_seed
from gateway.types import ReplicaId
from tests.kvevents.test_kv_fold import _tokens, engine_history

R = ReplicaId("e0")
W = {1: 1.0, 2: 0.5, 4: 0.25, 8: 0.1}


def _prompts() -> list[list[int]]:
    """The keys of every chain engine_history draws prompts from, cut at every length."""
    out = []
    for root in range(4):
        blocks = [root * 1000 + i + 1 for i in range(40)]
        tokens = [t for b in blocks for t in _tokens(b)]
        out.append(chain_keys(tokens, 16, root_seed()))
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("bound", [1 << 20, 60])
def test_deltas_leave_the_loop_index_answering_as_the_whole_one(seed: int, bound: int) -> None:
    # bound 60: the intake process's index drops its oldest blocks, which must reach the loop.
    whole, loop = EventIndex(max_blocks=bound), EventIndex(max_blocks=bound)
    prompts = _prompts()
    rng = random.Random(seed)
    for batch in engine_history(seed, steps=800):
        loop.apply_delta(R, apply_tracked(whole, R, batch.events, batch.ts))
        a, b = whole.blocks(R), loop.blocks(R)
        assert a is not None and b is not None
        assert a.media == b.media and a.holes == b.holes
        assert {m: n for m, n in a.by_medium.items() if n} == b.by_medium
        assert (a.orphans, a.skipped, a.block_size) == (b.orphans, b.skipped, b.block_size)
        keys = rng.choice(prompts)
        assert whole.matched(R, keys, W) == loop.matched(R, keys, W)
    assert not b.keys and not b.parent  # the loop keeps only what lookups read


def test_a_delta_counts_the_batch_events() -> None:
    whole = EventIndex()
    history = engine_history(1, steps=50)
    d = apply_tracked(whole, R, history[0].events, 12.5)
    assert (d.stored, d.removed, d.ts) == (
        sum(type(e).__name__ == "BlockStored" for e in history[0].events),
        sum(type(e).__name__ == "BlockRemoved" for e in history[0].events),
        12.5,
    )
