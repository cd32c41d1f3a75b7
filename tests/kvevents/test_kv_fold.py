"""`fold_history`: applying a folded replay leaves the index as the whole replay does, with
far fewer blocks entered on the way."""

from __future__ import annotations

import random

import pytest

from gateway.kvevents.fold import fold_history
from gateway.kvevents.index import EventIndex
from gateway.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch
from gateway.types import ReplicaId

R = ReplicaId("e0")


def _tokens(block: int) -> tuple[int, ...]:
    return tuple((block * 31 + t) % 5000 for t in range(16))


def _stored(chain: list[int], start: int, medium: str = "GPU") -> BlockStored:
    tokens = tuple(t for b in chain[start:] for t in _tokens(b))
    parent = chain[start - 1] if start else None
    return BlockStored(tuple(chain[start:]), parent, tokens, 16, None, medium)


def engine_history(seed: int, steps: int = 1500) -> list[EventBatch]:
    """What an engine with a small LRU cache publishes: prompts from a few shared roots
    store the blocks they miss (parent: the last block they hit), evictions take the
    least recently used blocks (holes included), a few prompts store again blocks that are
    held, some blocks are offloaded to and dropped
    from a CPU tier, now and then the cache is cleared."""
    rng = random.Random(seed)
    held: dict[int, None] = {}  # GPU blocks, least recently used first
    cpu: set[int] = set()
    batches: list[EventBatch] = []
    for _ in range(steps):
        events: list[Event] = []
        for _ in range(rng.randrange(1, 4)):
            x = rng.random()
            root = rng.randrange(4)
            chain = [root * 1000 + i + 1 for i in range(rng.randrange(1, 40))]
            if x < 0.5:
                hit = 0
                while hit < len(chain) and chain[hit] in held:
                    held[chain[hit]] = held.pop(chain[hit])
                    hit += 1
                if rng.random() < 0.1:
                    hit = 0  # stored again while held (a recomputed prefix)
                if hit < len(chain):
                    events.append(_stored(chain, hit))
                    held.update(dict.fromkeys(chain[hit:]))
            elif x < 0.85 and held:
                victims = list(held)[: rng.randrange(1, 30)]
                for v in victims:
                    del held[v]
                if rng.random() < 0.5:
                    victims.reverse()
                events.append(BlockRemoved(tuple(victims), rng.choice([None, "GPU"])))
            elif x < 0.93:
                events.append(_stored(chain, 0, "CPU"))
                cpu.update(chain)
            elif x < 0.985 and cpu:
                gone = rng.sample(sorted(cpu), min(len(cpu), rng.randrange(1, 20)))
                cpu.difference_update(gone)
                events.append(BlockRemoved(tuple(gone), "CPU"))
            elif x >= 0.985:
                events.append(AllBlocksCleared())
                held.clear()
                cpu.clear()
        batches.append(EventBatch(0.0, tuple(events)))
    return batches


def _blocks(batches: list[EventBatch]) -> int:
    return sum(len(e.block_hashes) for b in batches for e in b.events if isinstance(e, BlockStored))


@pytest.mark.parametrize("seed", range(6))
def test_a_folded_history_leaves_the_index_as_the_whole_one(seed: int) -> None:
    history = engine_history(seed)
    folded = fold_history(history)
    assert len(folded) == len(history)  # one batch per sequence number
    whole, short = EventIndex(max_blocks=1 << 20), EventIndex(max_blocks=1 << 20)
    for batch in history:
        whole.apply(R, batch.events)
    for batch in folded:
        short.apply(R, batch.events)
    a, b = whole.blocks(R), short.blocks(R)
    assert a is not None and b is not None
    assert a.keys == b.keys
    assert a.media == b.media
    assert {m: n for m, n in a.by_medium.items() if n} == {
        m: n for m, n in b.by_medium.items() if n
    }
    assert a.parent == b.parent and a.children == b.children
    assert a.holes == b.holes
    # The history's evicted prompts are not entered on the way.
    assert _blocks(folded) < 0.6 * _blocks(history)


def test_a_store_a_kept_one_chains_onto_is_kept_though_removed_later() -> None:
    # Block 1 is stored, block 2 chains onto it, then 1 is evicted (a hole): the index
    # could not have keyed 2 without 1, so 1's store stays.
    history = [
        EventBatch(0.0, (_stored([1], 0),)),
        EventBatch(0.0, (_stored([1, 2], 1),)),
        EventBatch(0.0, (BlockRemoved((1,)),)),
    ]
    folded = fold_history(history)
    assert folded == history
    # Without the child, it goes.
    assert fold_history([history[0], history[2]])[0].events == ()


def test_nothing_before_a_clear_is_kept() -> None:
    history = [
        EventBatch(0.0, (_stored([1, 2], 0),)),
        EventBatch(0.0, (AllBlocksCleared(), _stored([7], 0))),
    ]
    assert [b.events for b in fold_history(history)] == [(), history[1].events]
