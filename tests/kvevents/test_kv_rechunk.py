"""Engines paging at another size than kvgate's block size (SGLang's default page size 1, a
vLLM at block size 32): their events are re-cut on intake (gateway.kvevents.rechunk), so a
prompt keyed once at kvgate's block size still matches what they hold."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence

import openai
import pytest

from gateway.kvevents.index import EventIndex, SyncState
from gateway.kvevents.install import KVEventsFeature
from gateway.kvevents.rechunk import Rechunker
from gateway.kvevents.stage import salt_namespace
from gateway.kvevents.tokenkeys import chain_keys, in_namespace, root_seed
from gateway.kvevents.wire import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
)
from gateway.sim.profiles import PROFILES
from gateway.sim.server import KVEventsOptions, SimEngine
from gateway.testing.servers import gateway
from gateway.types import ReplicaId
from tests.kvevents.test_kv_routing import SYSTEM, ask, decisions, direct

R = ReplicaId("e0")
B = 16
TOKENS = list(range(1000, 1048))
KEYS = chain_keys(TOKENS, B, root_seed())
WEIGHTS = {1: 1.0, 2: 0.5}


def pages(p: int, first: int = 0, tokens: Sequence[int] = TOKENS) -> tuple[BlockHash, ...]:
    return tuple(range(first, first + len(tokens) // p))


def run(*events: Event, keys: Sequence[int] = KEYS) -> tuple[int, float]:
    """The leading kvgate blocks of `keys` the index holds after the re-cut events."""
    rechunk, index = Rechunker(B), EventIndex()
    for event in events:
        index.apply(R, rechunk.batch(EventBatch(0.0, (event,))).events)
    blocks = index.blocks(R)
    assert blocks is not None and blocks.block_size in (0, B)
    return index.matched(R, keys, WEIGHTS)


def stored(hashes: Sequence[BlockHash], parent: BlockHash | None, tokens: Sequence[int], p: int,
           medium: str | None = None) -> BlockStored:  # fmt: skip
    return BlockStored(tuple(hashes), parent, tuple(tokens), p, medium=medium)


def test_page_size_1_in_one_event_or_several() -> None:
    assert run(stored(pages(1), None, TOKENS, 1)) == (3, 3.0)
    # Cut anywhere: the leftover of one event continues in the next.
    assert run(
        stored(range(10), None, TOKENS[:10], 1),
        stored(range(10, 30), 9, TOKENS[10:30], 1),
        stored(range(30, 48), 29, TOKENS[30:], 1),
    ) == (3, 3.0)
    # Half a block is no block.
    assert run(stored(range(24), None, TOKENS[:24], 1)) == (1, 1.0)


def test_removing_any_page_of_a_block_removes_the_block() -> None:
    full = stored(pages(1), None, TOKENS, 1)
    assert run(full, BlockRemoved((20,))) == (1, 1.0)  # page 20 is in kvgate block 1
    assert run(full, BlockRemoved((47,))) == (2, 2.0)  # the last page: block 2
    assert run(full, BlockRemoved((0,))) == (0, 0.0)
    assert run(full, AllBlocksCleared()) == (0, 0.0)


def test_pages_larger_than_a_block_and_not_a_multiple_of_it() -> None:
    assert run(stored((1, 2), None, TOKENS[:32] + TOKENS[32:] + [7] * 16, 32)) == (3, 3.0)
    assert run(stored((1,), None, TOKENS[:32], 32), BlockRemoved((1,))) == (0, 0.0)
    # 24-token pages: kvgate block 1 straddles both pages.
    both = stored((1, 2), None, TOKENS, 24)
    assert run(both) == (3, 3.0)
    assert run(both, BlockRemoved((2,))) == (1, 1.0)
    assert run(both, BlockRemoved((1,))) == (0, 0.0)


def test_a_block_is_on_a_tier_when_every_page_of_it_is() -> None:
    both = stored((1, 2), None, TOKENS, 24)
    on_cpu = stored((1, 2), None, TOKENS, 24, medium="CPU")
    # Page 2 leaves the GPU but stays on CPU: blocks 1 and 2 count at CPU's weight.
    assert run(both, on_cpu, BlockRemoved((2,), "GPU")) == (3, 2.0)
    assert run(both, on_cpu, BlockRemoved((2,), "GPU"), BlockRemoved((2,), "CPU")) == (1, 1.0)


def test_orphans_and_salted_pages() -> None:
    assert run(stored(range(100, 148), 99, TOKENS, 1)) == (0, 0.0)
    salted = dataclasses.replace(stored(pages(1), None, TOKENS, 1), cache_salt="tenant-a")
    assert run(salted) == (0, 0.0)  # never a plain prompt's hit
    ns = salt_namespace({"cache_salt": "tenant-a"})
    assert ns is not None
    assert run(salted, keys=in_namespace(KEYS, ns)) == (3, 3.0)


def test_the_bound_forgets_the_oldest_pages_and_their_blocks() -> None:
    rechunk, index = Rechunker(B, max_pages=32), EventIndex()
    index.apply(R, rechunk.batch(EventBatch(0.0, (stored(pages(1), None, TOKENS, 1),))).events)
    assert len(rechunk) == 32
    assert index.matched(R, KEYS, WEIGHTS)[0] == 0  # pages 0..15 forgotten: block 0 gone


async def _until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("page", [1, 32])
async def test_an_sglang_engine_at_another_page_size_gives_a_usable_index(page: int) -> None:
    """Two simulated SGLang engines at page size `page` (kvgate keys at 16), found by
    discovery. The conversation's engine evicts it, the other engine holds it (another
    client sent it there): the next turn follows the engines' events to the other one."""
    profile = dataclasses.replace(PROFILES["tiny"], block_size=page, num_gpu_blocks=1024 // page)
    engines = [
        SimEngine(profile, index=i, flavor="sglang", kv_events=KVEventsOptions()) for i in range(2)
    ]
    for e in engines:
        await e.start()
    try:
        settings = {
            "kv_events": {"enabled": True, "block_size": B, "tokenizer": {"kind": "sim"}},
            "session": {"block_tokens": 16},
        }
        async with (
            gateway(engines, **settings) as gw,
            openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client,
        ):
            feature: KVEventsFeature = gw.state.extras["kv_events"]
            turn1 = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Where is the retry budget enforced? " * 6},
            ]
            home, _, answer = await ask(client, turn1)
            other = "e1" if home == "e0" else "e0"
            by_id = {f"e{e.index}": e for e in engines}
            await direct(by_id[other], turn1)
            for i in range(4):
                await direct(by_id[home], [{"role": "user", "content": f"unrelated {i} " * 220}])
            await _until(lambda: len(feature.bridge) > 0)
            await _until(lambda: feature.feed.state(ReplicaId(other)) is SyncState.SYNCED)
            held = feature.index.blocks(ReplicaId(other))
            assert held is not None and held.block_size == B and held.media
            turn2 = turn1 + [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "And the backoff? " * 4},
            ]
            served, cached, _ = await ask(client, turn2)
            assert served == other and cached > 0
            assert decisions(gw, "evicted") == 1
    finally:
        for e in engines:
            await e.stop()
