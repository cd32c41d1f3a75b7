"""Paged KV cache with automatic prefix caching, after vLLM's block pool.

* Fixed-size blocks; a request holds `ceil(tokens / block_size)` of them.
* A block that becomes full of prompt tokens is registered under its chained block hash.
  A later request whose hashes match reuses it (reference count + 1) instead of
  recomputing: its cached tokens are the longest run of matching whole blocks.
* Freed blocks keep their hash and join the tail of the free queue; allocation takes from
  the head, evicting the hash of a cached block it reuses, so the least recently freed
  cached block is evicted first. A request's blocks are freed in reverse order, so the end
  of a prompt is evicted before its (more shareable) beginning.
* With `events` set to a list, the cache records what vLLM's KV event publisher reports
  (gateway.kvevents.wire): `BlockStored` for each run of newly cached blocks (with their
  token ids), `BlockRemoved` on eviction, `AllBlocksCleared` on a reset; the engine's
  driver takes and publishes them after every step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.kvevents.wire import GPU, AllBlocksCleared, BlockRemoved, BlockStored, Event


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


@dataclass(slots=True)
class _Holding:
    blocks: list[int] = field(default_factory=list)
    # Blocks [0, num_hashed) already carry their hash (or were found cached).
    num_hashed: int = 0


class KVCache:
    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}
        self._held: dict[str, _Holding] = {}
        self.evictions = 0
        self.events: list[Event] | None = None

    # ---- queries -------------------------------------------------------------------
    @property
    def blocks_in_use(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_of(self, owner: str) -> list[int]:
        holding = self._held.get(owner)
        return list(holding.blocks) if holding else []

    def owners(self) -> list[str]:
        return list(self._held)

    def blocks_needed(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def match_prefix(self, hashes: Sequence[int], max_tokens: int) -> list[int]:
        """Block ids of the longest cached run of `hashes`, at most `max_tokens` long."""
        limit = max(0, max_tokens) // self.block_size
        hit: list[int] = []
        cached = self._cached
        for h in hashes[:limit]:
            block_id = cached.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    # ---- allocation ----------------------------------------------------------------
    def can_allocate(self, owner: str, tokens: int, computed: Sequence[int] = ()) -> bool:
        holding = self._held.get(owner)
        have = len(holding.blocks) if holding else len(computed)
        new = max(0, self.blocks_needed(tokens) - have)
        revived = 0 if holding else sum(1 for b in computed if self._blocks[b].ref_cnt == 0)
        return new + revived <= len(self._free)

    def allocate(self, owner: str, tokens: int, computed: Sequence[int] = ()) -> bool:
        """Make `owner` hold enough blocks for `tokens` tokens; False (no change) if full.

        `computed` (cache hits from `match_prefix`) is only used on the owner's first
        allocation; those blocks are shared, not copied.
        """
        if not self.can_allocate(owner, tokens, computed):
            return False
        holding = self._held.get(owner)
        if holding is None:
            holding = _Holding()
            for block_id in computed:
                self._touch(block_id)
                holding.blocks.append(block_id)
            holding.num_hashed = len(computed)
            self._held[owner] = holding
        for _ in range(self.blocks_needed(tokens) - len(holding.blocks)):
            holding.blocks.append(self._take_free())
        return True

    def cache_full_blocks(
        self, owner: str, hashes: Sequence[int], num_full: int, token_ids: Sequence[int] = ()
    ) -> None:
        """Register the hashes of the owner's first `num_full` blocks (those now computed)."""
        holding = self._held.get(owner)
        if holding is None:
            return
        upto = min(num_full, len(hashes), len(holding.blocks))
        run_start = -1
        for i in range(holding.num_hashed, upto):
            h = hashes[i]
            block = self._blocks[holding.blocks[i]]
            # A concurrent request may have cached the same content first; keep that one.
            if h not in self._cached and block.block_hash is None:
                block.block_hash = h
                self._cached[h] = block.block_id
                if run_start < 0:
                    run_start = i
            elif run_start >= 0:
                self._stored(hashes, run_start, i, token_ids)
                run_start = -1
        if run_start >= 0:
            self._stored(hashes, run_start, upto, token_ids)
        holding.num_hashed = max(holding.num_hashed, upto)

    def _stored(self, hashes: Sequence[int], start: int, end: int, ids: Sequence[int]) -> None:
        bs = self.block_size
        if self.events is None or len(ids) < end * bs:
            return
        self.events.append(
            BlockStored(
                tuple(hashes[start:end]),
                hashes[start - 1] if start else None,
                tuple(ids[start * bs : end * bs]),
                bs,
                None,
                GPU,
            )
        )

    def _removed(self, block_hash: int) -> None:
        events = self.events
        if events is None:
            return
        last = events[-1] if events else None
        if isinstance(last, BlockRemoved):
            events[-1] = BlockRemoved((*last.block_hashes, block_hash), GPU)
        else:
            events.append(BlockRemoved((block_hash,), GPU))

    def drop_cached(self) -> None:
        """Forget every cached hash, in use or not (an engine restart's empty cache)."""
        for block in self._blocks:
            block.block_hash = None
        self._cached.clear()
        for holding in self._held.values():
            holding.num_hashed = len(holding.blocks)  # their blocks are no longer shared
        if self.events is not None:
            self.events.append(AllBlocksCleared())

    def free(self, owner: str) -> int:
        """Release everything `owner` holds; returns how many blocks it held."""
        holding = self._held.pop(owner, None)
        if holding is None:
            return 0
        for block_id in reversed(holding.blocks):
            block = self._blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
        return len(holding.blocks)

    def reset_prefix_cache(self) -> bool:
        if self.blocks_in_use:
            return False
        for block in self._blocks:
            block.block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    # ---- internals -----------------------------------------------------------------
    def _touch(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_cnt == 0:
            del self._free[block_id]
        block.ref_cnt += 1

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            self._removed(block.block_hash)
            block.block_hash = None
            self.evictions += 1
        block.ref_cnt = 1
        return block_id
