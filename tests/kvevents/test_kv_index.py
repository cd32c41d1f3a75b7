"""The event-fed index: keyed from token ids, media kept and weighed, bounded, exact."""

from __future__ import annotations

from typing import Any

from gateway.kvevents.index import EventIndex
from gateway.kvevents.tokenkeys import chain_keys, root_seed
from gateway.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored
from gateway.types import ReplicaId

R = ReplicaId("r")
W = {1: 1.0, 2: 0.5}
TOKENS = list(range(1000, 1064))  # 4 blocks of 16
KEYS = chain_keys(TOKENS, 16, root_seed())


def stored(
    hashes: list[int], parent: int | None, tokens: list[int], medium: str = "GPU"
) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), 16, None, medium)


def test_a_chain_stored_in_two_events_matches_the_prompt_keys() -> None:
    index = EventIndex()
    index.apply(R, [stored([1, 2], None, TOKENS[:32])])
    index.apply(R, [stored([3, 4], 2, TOKENS[32:])])
    assert index.matched(R, KEYS, W) == (4, 4.0)
    other = chain_keys([7] + TOKENS[1:], 16, root_seed())
    assert index.matched(R, other, W) == (0, 0.0)


def test_removal_cuts_the_match_where_the_engine_would_stop() -> None:
    index = EventIndex()
    index.apply(R, [stored([1, 2, 3, 4], None, TOKENS)])
    index.apply(R, [BlockRemoved((2,), "GPU")])
    assert index.matched(R, KEYS, W) == (1, 1.0)
    index.apply(R, [AllBlocksCleared()])
    assert index.matched(R, KEYS, W) == (0, 0.0)


def test_media_are_kept_apart_and_weighed_by_the_best_copy() -> None:
    index = EventIndex()
    index.apply(R, [stored([1, 2], None, TOKENS[:32], "GPU")])
    index.apply(R, [stored([1, 2], None, TOKENS[:32], "CPU")])
    index.apply(R, [BlockRemoved((2,), "GPU")])
    # Block 1 on both tiers, block 2 only offloaded.
    assert index.matched(R, KEYS, W) == (2, 1.5)
    blocks = index.blocks(R)
    assert blocks is not None and blocks.by_medium == {1: 1, 2: 2}
    index.apply(R, [BlockRemoved((2,), "CPU")])
    assert index.matched(R, KEYS, W) == (1, 1.0)


def test_orphans_and_malformed_blocks_are_left_out() -> None:
    index = EventIndex()
    index.apply(R, [stored([3, 4], 2, TOKENS[32:])])  # parent never seen
    index.apply(R, [stored([1, 2], None, TOKENS[:20])])  # 20 tokens for 2 blocks
    blocks = index.blocks(R)
    assert blocks is not None and (blocks.orphans, blocks.skipped) == (2, 2)
    assert index.matched(R, KEYS, W) == (0, 0.0)


def test_lora_and_extra_keys_never_match_plain_prompts() -> None:
    index = EventIndex()
    index.apply(R, [BlockStored((1,), None, tuple(TOKENS[:16]), 16, 5, "GPU")])
    index.apply(
        ReplicaId("s"), [BlockStored((1,), None, tuple(TOKENS[:16]), 16, None, "GPU", (("salt",),))]
    )
    assert index.matched(R, KEYS, W) == (0, 0.0)
    assert index.matched(ReplicaId("s"), KEYS, W) == (0, 0.0)


def test_other_kv_cache_groups_are_ignored() -> None:
    index = EventIndex()
    index.apply(R, [BlockStored((1,), None, tuple(TOKENS[:16]), 16, None, "GPU", None, 1)])
    assert index.matched(R, KEYS, W) == (0, 0.0)


def test_memory_is_bounded_oldest_first() -> None:
    index = EventIndex(max_blocks=3)
    index.apply(R, [stored([1, 2, 3, 4], None, TOKENS)])
    blocks = index.blocks(R)
    assert blocks is not None and len(blocks.keys) == 3 and 1 not in blocks.keys
    assert sum(blocks.by_medium.values()) == 3


def test_a_full_index_keeps_the_newest_blocks_in_order_through_many_evictions() -> None:
    # Past the bound, each event evicts its size in blocks from the front, and the hash
    # table is compacted now and then (gateway.kvevents.index._evict): what is left must be
    # exactly the newest `max_blocks`, oldest first, with media and counts to match.
    index = EventIndex(max_blocks=50)
    for i in range(40):
        base = 100 * i
        tokens = [base + t for t in range(16 * 7)]
        index.apply(R, [stored(list(range(base + 1, base + 8)), None, tokens)])
        blocks = index.blocks(R)
        assert blocks is not None
        newest = [h for j in range(i + 1) for h in range(100 * j + 1, 100 * j + 8)][-50:]
        assert list(blocks.keys) == newest
        assert set(blocks.media) == set(blocks.keys.values())
        assert sum(blocks.by_medium.values()) == len(newest)


def test_fast_and_slow_lookups_agree_with_a_plain_walk_under_random_churn() -> None:
    import random

    rng = random.Random(7)
    tokens = list(range(5000, 5000 + 16 * 30))
    keys = chain_keys(tokens, 16, root_seed())
    index = EventIndex()
    for _ in range(400):
        start = rng.randrange(0, 30)
        if rng.random() < 0.6:
            end = min(30, start + rng.randrange(1, 6))
            medium = "GPU" if rng.random() < 0.9 else "CPU"
            parent = start if start else None  # engine hash of block i is i + 1
            if (
                parent is not None
                and index.blocks(R) is not None
                and parent not in index.blocks(R).keys
            ):  # type: ignore[union-attr]
                continue
            index.apply(
                R,
                [
                    stored(
                        list(range(start + 1, end + 1)),
                        parent,
                        tokens[16 * start : 16 * end],
                        medium,
                    )
                ],
            )
        else:
            index.apply(R, [BlockRemoved((start + 1,), "GPU" if rng.random() < 0.8 else "CPU")])
        blocks = index.blocks(R)
        assert blocks is not None
        walk = 0
        for k in keys:
            if not blocks.media.get(k):
                break
            walk += 1
        assert index.matched(R, keys, W)[0] == walk
        # The hole count is what it claims to be.
        holes = sum(1 for k, p in blocks.parent.items() if p not in blocks.media)
        assert blocks.holes == holes


def assert_same(one: EventIndex, other: EventIndex) -> None:
    """Both indexes hold R's blocks alike, down to the order of the bound's queue."""
    a, b = one.blocks(R), other.blocks(R)
    assert a is not None and b is not None
    assert list(a.keys.items()) == list(b.keys.items())
    assert a.media == b.media and a.by_medium == b.by_medium
    assert a.parent == b.parent and a.children == b.children
    assert (a.holes, a.orphans) == (b.holes, b.orphans)


def test_a_fresh_chain_stored_in_bulk_equals_storing_it_block_by_block() -> None:
    # EventIndex stores a chain the replica does not hold at all in bulk (_stored_fresh);
    # under random stores (fresh, overlapping, other tiers), removals and orphans it must
    # leave the replica exactly as the block-by-block path does.
    import random

    class EachOnly(EventIndex):
        @staticmethod
        def _stored_fresh(*args: object) -> bool:
            return False

    rng = random.Random(3)
    tokens = [rng.randrange(1000) for _ in range(16 * 60)]
    bulk, each = EventIndex(max_blocks=45), EachOnly(max_blocks=45)
    fresh = 0
    for _ in range(600):
        start = rng.randrange(0, 60)
        if rng.random() < 0.6:
            end = min(60, start + rng.randrange(1, 12))
            medium = "GPU" if rng.random() < 0.85 else "CPU"
            parent = start if start and rng.random() < 0.95 else None
            event = stored(
                list(range(start + 1, end + 1)), parent, tokens[16 * start : 16 * end], medium
            )
            held = bulk.blocks(R)
            if held is not None and not any(h in held.keys for h in event.block_hashes):
                fresh += 1
        else:
            event = BlockRemoved((start + 1,), "GPU" if rng.random() < 0.8 else "CPU")
        bulk.apply(R, [event])
        each.apply(R, [event])
        assert_same(bulk, each)
    assert fresh > 50  # the bulk path ran


def test_a_removal_in_bulk_equals_removing_block_by_block() -> None:
    # EventIndex removes blocks that take all their held children with them in bulk
    # (_removed_whole); under random stores and removals of runs (tail first, head first,
    # with duplicates, blocks on other tiers, blocks not held) it must leave the replica
    # exactly as the block-by-block path does.
    import random

    class EachOnly(EventIndex):
        @staticmethod
        def _removed_whole(*args: object) -> bool:
            return False

    class Counted(EventIndex):
        whole = 0

        @staticmethod
        def _removed_whole(*args: Any) -> bool:
            done = EventIndex._removed_whole(*args)
            Counted.whole += done
            return done

    rng = random.Random(5)
    tokens = [rng.randrange(1000) for _ in range(16 * 60)]
    bulk, each = Counted(max_blocks=50), EachOnly(max_blocks=50)
    for _ in range(1500):
        start = rng.randrange(0, 60)
        if rng.random() < 0.5:
            end = min(60, start + rng.randrange(1, 12))
            medium = "GPU" if rng.random() < 0.85 else "CPU"
            parent = start if start and rng.random() < 0.95 else None
            event: BlockStored | BlockRemoved = stored(
                list(range(start + 1, end + 1)), parent, tokens[16 * start : 16 * end], medium
            )
        else:
            held = bulk.blocks(R)
            if held is not None and rng.random() < 0.6:  # a held chain's whole tail
                run = [h for h in range(start + 1, 61) if h in held.keys] or [start + 1]
            else:
                run = list(range(start + 1, min(61, start + 1 + rng.randrange(1, 15))))
            if rng.random() < 0.5:
                run.reverse()  # tail first, as vLLM frees a request's blocks
            if rng.random() < 0.05:
                run.append(run[0])
            event = BlockRemoved(tuple(run), "GPU" if rng.random() < 0.85 else "CPU")
        bulk.apply(R, [event])
        each.apply(R, [event])
        assert_same(bulk, each)
    assert Counted.whole > 30  # the bulk path ran
