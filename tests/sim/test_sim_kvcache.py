from __future__ import annotations

import random

import pytest

from gateway.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored
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


# --- random operations under KV pressure, checked against invariants ---------------------


def _prompt(rng: random.Random, prefixes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Block hashes of a prompt: often a shared prefix, then blocks of its own."""
    base = rng.choice(prefixes)[: rng.randint(0, 6)] if rng.random() < 0.7 else ()
    return base + tuple(rng.getrandbits(40) for _ in range(rng.randint(0, 5)))


def _check(kv: KVCache, mirror: set[int], held: dict[str, int]) -> None:
    counts: dict[int, int] = {}
    for owner in kv.owners():
        blocks = kv.blocks_of(owner)
        assert len(blocks) == kv.blocks_needed(held[owner])  # exactly what it asked for
        assert len(set(blocks)) == len(blocks)  # no block twice in one request
        for b in blocks:
            counts[b] = counts.get(b, 0) + 1
    # Blocks in use are exactly the blocks some request holds, and never more than exist.
    assert kv.blocks_in_use == len(counts) <= kv.num_blocks
    assert 0.0 <= kv.usage <= 1.0
    # What a KV-event subscriber has folded equals what the cache holds.
    events, kv.events = kv.events or [], []
    for ev in events:
        if isinstance(ev, BlockStored):
            assert not mirror & set(ev.block_hashes), "stored twice without a removal"
            mirror.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            assert set(ev.block_hashes) <= mirror, "removed what was never stored"
            mirror.difference_update(ev.block_hashes)
        else:
            assert isinstance(ev, AllBlocksCleared)
            mirror.clear()
    assert mirror == set(kv._cached)
    # A cached block maps back to the hash it is cached under.
    assert all(kv._blocks[b].block_hash == h for h, b in kv._cached.items())


@pytest.mark.parametrize("seed", range(12))
def test_random_operations_keep_the_pool_and_its_event_stream_consistent(seed: int) -> None:
    rng = random.Random(seed)
    bs = 4
    kv = KVCache(num_blocks=rng.randint(6, 24), block_size=bs)
    kv.events = []
    prefixes = [tuple(rng.getrandbits(40) for _ in range(8)) for _ in range(3)]
    mirror: set[int] = set()
    held: dict[str, int] = {}
    for step in range(300):
        op = rng.random()
        if op < 0.45:
            owner = f"r{step}"
            hashes = _prompt(rng, prefixes)
            tokens = len(hashes) * bs + rng.randint(1, bs - 1)
            hit = kv.match_prefix(hashes, tokens - 1)  # the last token is always computed
            assert len(hit) <= min(len(hashes), (tokens - 1) // bs)
            before = (kv.blocks_in_use, kv.num_cached_blocks, kv.evictions)
            could = kv.can_allocate(owner, tokens, hit)
            assert kv.allocate(owner, tokens, hit) is could
            if not could:  # a refusal changes nothing
                assert (kv.blocks_in_use, kv.num_cached_blocks, kv.evictions) == before
                continue
            held[owner] = tokens
            ids = [rng.randrange(1000) for _ in range(tokens)]
            kv.cache_full_blocks(owner, hashes, tokens // bs, ids)
        elif op < 0.65 and held:
            owner = rng.choice(sorted(held))
            grown = held[owner] + rng.randint(1, 2 * bs)  # decoding: the request grows
            if kv.allocate(owner, grown):
                held[owner] = grown
        elif op < 0.95 and held:
            owner = rng.choice(sorted(held))
            assert kv.free(owner) == kv.blocks_needed(held.pop(owner))
            assert kv.free(owner) == 0  # freeing twice frees nothing
        else:
            assert kv.reset_prefix_cache() is (not held)
        _check(kv, mirror, held)
    for owner in list(held):
        kv.free(owner)
    assert kv.blocks_in_use == 0 and kv.usage == 0.0
    assert kv.reset_prefix_cache()
    _check(kv, mirror, {})
    assert mirror == set()


def test_a_cached_prefix_survives_pressure_longer_than_a_tail() -> None:
    kv = KVCache(num_blocks=6, block_size=4)
    assert kv.allocate("a", 16)
    kv.cache_full_blocks("a", (1, 2, 3, 4), 4)
    kv.free("a")  # its blocks join the free queue tail last-first: 4, 3, 2, 1
    assert kv.allocate("b", 12)  # two never-cached blocks, then evicts hash 4
    assert kv.match_prefix((1, 2, 3, 4), 16) == kv.match_prefix((1, 2, 3), 16)
    assert len(kv.match_prefix((1, 2, 3, 4), 16)) == 3
    assert kv.evictions == 1


def test_an_engine_restart_forgets_hashes_but_not_what_requests_hold() -> None:
    kv = KVCache(num_blocks=4, block_size=4)
    kv.events = []
    assert kv.allocate("a", 8)
    kv.cache_full_blocks("a", (1, 2), 2, list(range(8)))
    kv.drop_cached()
    assert kv.match_prefix((1, 2), 8) == []
    assert kv.blocks_in_use == 2 and kv.num_cached_blocks == 0
    assert isinstance(kv.events[-1], AllBlocksCleared)
    kv.cache_full_blocks("a", (1, 2), 2, list(range(8)))  # already computed: not cached again
    assert kv.num_cached_blocks == 0


def test_a_pool_with_no_blocks_is_refused() -> None:
    for n, bs in ((0, 16), (4, 0), (-1, 16)):
        with pytest.raises(ValueError, match="must be positive"):
            KVCache(n, bs)
