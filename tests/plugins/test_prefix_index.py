from __future__ import annotations

from gateway.types import ReplicaId
from plugins.prefix_index import BlockLRU, PrefixIndex


def test_match_is_longest_held_prefix() -> None:
    lru = BlockLRU(100)
    lru.add([1, 2, 3, 4])
    assert lru.matched([1, 2, 3, 4, 5, 6]) == 4
    assert lru.matched([1, 2, 9]) == 2
    assert lru.matched([7, 1, 2]) == 0
    assert lru.matched([]) == 0


def test_eviction_drops_prompt_tails_first() -> None:
    lru = BlockLRU(6)
    lru.add([1, 2, 3, 4])
    lru.add([10, 11, 12, 13])
    # Over capacity by two: the tail of the older prompt goes, its head stays matchable.
    assert len(lru) == 6
    assert lru.matched([1, 2, 3, 4]) == 2
    assert lru.matched([10, 11, 12, 13]) == 4


def test_reuse_refreshes_a_prefix() -> None:
    lru = BlockLRU(4)
    lru.add([1, 2])
    lru.add([5, 6])
    lru.add([1, 2])  # touched again: now the most recent
    lru.add([7, 8])
    assert lru.matched([1, 2]) == 2
    assert lru.matched([5, 6]) == 0


def test_index_sizes_each_replica_from_its_capacity() -> None:
    idx = PrefixIndex(default_capacity_tokens=64)
    a, b = ReplicaId("a"), ReplicaId("b")
    idx.set_capacity(b, 160, block_tokens=16)
    idx.record(a, list(range(100)), 16)
    idx.record(b, list(range(100)), 16)
    assert idx.size(a) == 4 and idx.size(b) == 10
    idx.set_capacity(b, 32, block_tokens=16)
    assert idx.size(b) == 2
    assert idx.matched(b, list(range(100))) == 2
    idx.forget(a)
    assert idx.size(a) == 0 and idx.total_blocks == 2
