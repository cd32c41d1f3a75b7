"""`PrefixIndex` under random traffic: the reverse map (block -> holders) stays in step with
every replica's LRU through additions, evictions, resizes and forgets, and the batched
`matched_sparse` answers what `matched` answers replica by replica."""

from __future__ import annotations

import random

import pytest

from gateway.types import ReplicaId
from plugins.prefix_index import PrefixIndex

REPLICAS = [ReplicaId(f"r{i}") for i in range(5)]
BLOCK = 16


def _prompts(rng: random.Random, count: int) -> list[list[int]]:
    """Conversations that share system prompts and grow turn by turn, as real traffic does."""
    systems = [[rng.randrange(1 << 40) for _ in range(rng.randint(1, 6))] for _ in range(4)]
    convs: list[list[int]] = []
    out = []
    for _ in range(count):
        if convs and rng.random() < 0.6:
            conv = rng.choice(convs)
            conv.extend(rng.randrange(1 << 40) for _ in range(rng.randint(1, 4)))
        else:
            conv = list(rng.choice(systems))
            conv.extend(rng.randrange(1 << 40) for _ in range(rng.randint(0, 5)))
            convs.append(conv)
        out.append(list(conv))
    return out


def _check_holders(idx: PrefixIndex) -> None:
    expected: dict[int, set[ReplicaId]] = {}
    for replica, lru in idx._lrus.items():
        for block in lru._blocks:
            expected.setdefault(block, set()).add(replica)
    actual = {
        block: set(held) if isinstance(held, set) else {held}
        for block, held in idx._holders.items()
    }
    assert actual == expected
    # A single holder is kept bare, never as a one-element set.
    assert not any(isinstance(h, set) and len(h) < 2 for h in idx._holders.values())


@pytest.mark.parametrize("seed", range(6))
def test_reverse_map_and_sparse_match_follow_the_lrus(seed: int) -> None:
    rng = random.Random(seed)
    idx = PrefixIndex(default_capacity_tokens=BLOCK * 24)
    position = {r: i for i, r in enumerate(REPLICAS)}
    prompts = _prompts(rng, 300)
    for step, prompt in enumerate(prompts):
        replica = rng.choice(REPLICAS)
        roll = rng.random()
        if roll < 0.03:
            idx.forget(replica)
        elif roll < 0.08:
            idx.set_capacity(replica, BLOCK * rng.randint(1, 40), BLOCK)
        else:
            idx.record(replica, prompt, BLOCK)
        if step % 25 == 0:
            _check_holders(idx)
        probe = rng.choice(prompts[: step + 1])
        sparse = idx.matched_sparse(position, probe)
        dense = {position[r]: idx.matched(r, probe) for r in REPLICAS}
        assert sparse == {i: n for i, n in dense.items() if n > 0}
    _check_holders(idx)
    assert idx.total_blocks == sum(idx.size(r) for r in REPLICAS)


def test_sparse_match_only_reports_replicas_in_the_position_map() -> None:
    idx = PrefixIndex(default_capacity_tokens=BLOCK * 100)
    a, b = REPLICAS[:2]
    idx.record(a, [1, 2, 3], BLOCK)
    idx.record(b, [1, 2], BLOCK)
    assert idx.matched_sparse({b: 0}, [1, 2, 3]) == {0: idx.matched(b, [1, 2, 3])}
    assert idx.matched_sparse({}, [1, 2, 3]) == {}
    assert idx.matched_sparse({a: 0, b: 1}, []) == {}
    assert idx.matched_sparse({a: 0, b: 1}, [9, 1, 2]) == {}


def test_capacity_is_never_below_one_block() -> None:
    idx = PrefixIndex(default_capacity_tokens=1, capacity_factor=0.01)
    a = REPLICAS[0]
    idx.record(a, [1, 2, 3], BLOCK)
    assert idx.size(a) == 1 and idx.matched(a, [1]) == 1
    idx.set_capacity(a, 0, BLOCK)  # ignored: an engine that reports no capacity
    idx.set_capacity(a, -5, BLOCK)
    assert idx.size(a) == 1
    _check_holders(idx)
