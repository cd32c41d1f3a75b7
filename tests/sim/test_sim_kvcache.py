from __future__ import annotations

from gateway.sim.kvcache import KVCache


def test_prefix_match_is_longest_run_of_whole_blocks() -> None:
    kv = KVCache(num_blocks=8, block_size=4)
    assert kv.allocate("a", 12)
    kv.cache_full_blocks("a", (11, 12, 13), 3)
    assert kv.match_prefix((11, 12, 13), 100) == kv.blocks_of("a")
    assert len(kv.match_prefix((11, 12, 99), 100)) == 2
    assert kv.match_prefix((99, 12, 13), 100) == []
    # At most max_tokens, in whole blocks.
    assert len(kv.match_prefix((11, 12, 13), 11)) == 2


def test_shared_blocks_are_reference_counted() -> None:
    kv = KVCache(num_blocks=4, block_size=4)
    assert kv.allocate("a", 8)
    kv.cache_full_blocks("a", (1, 2), 2)
    hit = kv.match_prefix((1, 2), 8)
    assert kv.allocate("b", 12, hit)
    assert kv.blocks_in_use == 3  # two shared + one new
    kv.free("a")
    assert kv.blocks_in_use == 3  # b still references the shared ones
    kv.free("b")
    assert kv.blocks_in_use == 0
    assert kv.num_cached_blocks == 2  # freed, but still cached


def test_lru_eviction_of_free_cached_blocks() -> None:
    kv = KVCache(num_blocks=4, block_size=4)
    for owner, hashes in (("a", (1, 2)), ("b", (3, 4))):
        assert kv.allocate(owner, 8)
        kv.cache_full_blocks(owner, hashes, 2)
        kv.free(owner)
    assert kv.num_cached_blocks == 4 and kv.evictions == 0
    # Re-using "a"'s prefix moves it out of the free queue; the next allocation must evict
    # from "b", the least recently freed, starting with its last block.
    hit = kv.match_prefix((1, 2), 8)
    assert len(hit) == 2
    assert kv.allocate("c", 12, hit)
    assert kv.evictions == 1
    assert len(kv.match_prefix((3, 4), 8)) == 1
    assert len(kv.match_prefix((1, 2), 8)) == 2


def test_allocation_fails_cleanly_when_full() -> None:
    kv = KVCache(num_blocks=2, block_size=4)
    assert kv.allocate("a", 8)
    assert not kv.can_allocate("b", 1)
    assert not kv.allocate("b", 1)
    assert kv.blocks_of("b") == []
    assert kv.usage == 1.0
    kv.free("a")
    assert kv.usage == 0.0


def test_growth_allocates_only_missing_blocks() -> None:
    kv = KVCache(num_blocks=4, block_size=4)
    assert kv.allocate("a", 3)
    first = kv.blocks_of("a")
    assert kv.allocate("a", 4)
    assert kv.blocks_of("a") == first
    assert kv.allocate("a", 5)
    assert len(kv.blocks_of("a")) == 2


def test_duplicate_content_is_not_registered_twice() -> None:
    kv = KVCache(num_blocks=4, block_size=4)
    assert kv.allocate("a", 4) and kv.allocate("b", 4)
    kv.cache_full_blocks("a", (7,), 1)
    kv.cache_full_blocks("b", (7,), 1)
    assert kv.num_cached_blocks == 1
    assert kv.match_prefix((7,), 8) == kv.blocks_of("a")


def test_reset_prefix_cache_only_when_idle() -> None:
    kv = KVCache(num_blocks=2, block_size=4)
    assert kv.allocate("a", 4)
    kv.cache_full_blocks("a", (5,), 1)
    assert not kv.reset_prefix_cache()
    kv.free("a")
    assert kv.reset_prefix_cache()
    assert kv.match_prefix((5,), 8) == []
