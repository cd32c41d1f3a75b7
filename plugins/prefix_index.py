"""Approximate per-replica index of the prompt blocks recently sent to each replica.

Each replica has an LRU of chained block hashes whose size follows the replica's KV
capacity (in blocks), so the index forgets roughly what the engine's own cache evicts.
Blocks of a request are touched deepest-first, which leaves a prefix more recent than
its extensions: eviction then drops the tails of prompts first (as vLLM does), and the
set of a replica's blocks stays prefix-closed, so a binary search finds the match length.

Memory: one dict entry per indexed block. Lookup: O(log L) per replica for an L-block
prompt, O(1) for a replica that does not hold the first block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from gateway.types import ReplicaId


class BlockLRU:
    __slots__ = ("_blocks", "capacity")

    def __init__(self, capacity: int) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.capacity = max(1, capacity)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def add(self, hashes: Sequence[int]) -> None:
        blocks = self._blocks
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        self._trim()

    def resize(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._trim()

    def _trim(self) -> None:
        blocks = self._blocks
        excess = len(blocks) - self.capacity
        for _ in range(max(0, excess)):
            blocks.popitem(last=False)

    def matched(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks of `hashes` held here."""
        blocks = self._blocks
        if not hashes or hashes[0] not in blocks:
            return 0
        lo, hi = 1, len(hashes)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo


class PrefixIndex:
    """One `BlockLRU` per replica, sized in blocks from each replica's capacity in tokens."""

    def __init__(self, default_capacity_tokens: int, capacity_factor: float = 1.0) -> None:
        self._default_tokens = default_capacity_tokens
        self._factor = capacity_factor
        self._capacity_tokens: dict[ReplicaId, int] = {}
        self._lrus: dict[ReplicaId, BlockLRU] = {}

    def _blocks_for(self, replica: ReplicaId, block_tokens: int) -> int:
        tokens = self._capacity_tokens.get(replica, self._default_tokens)
        return max(1, int(tokens * self._factor) // max(1, block_tokens))

    def set_capacity(self, replica: ReplicaId, tokens: int, block_tokens: int) -> None:
        if tokens <= 0 or self._capacity_tokens.get(replica) == tokens:
            return
        self._capacity_tokens[replica] = tokens
        lru = self._lrus.get(replica)
        if lru is not None:
            lru.resize(self._blocks_for(replica, block_tokens))

    def record(self, replica: ReplicaId, hashes: Sequence[int], block_tokens: int) -> None:
        lru = self._lrus.get(replica)
        if lru is None:
            lru = self._lrus[replica] = BlockLRU(self._blocks_for(replica, block_tokens))
        lru.add(hashes)

    def matched(self, replica: ReplicaId, hashes: Sequence[int]) -> int:
        lru = self._lrus.get(replica)
        return lru.matched(hashes) if lru is not None else 0

    def matched_many(self, replicas: Sequence[ReplicaId], hashes: Sequence[int]) -> list[int]:
        """`matched` for each replica; O(1) for those that lack the first block."""
        if not hashes:
            return [0] * len(replicas)
        first = hashes[0]
        lrus = self._lrus
        out = []
        for replica in replicas:
            lru = lrus.get(replica)
            out.append(lru.matched(hashes) if lru is not None and first in lru else 0)
        return out

    def holds_first(self, replica: ReplicaId, first: int) -> bool:
        lru = self._lrus.get(replica)
        return lru is not None and first in lru

    def forget(self, replica: ReplicaId) -> None:
        self._lrus.pop(replica, None)
        self._capacity_tokens.pop(replica, None)

    def size(self, replica: ReplicaId) -> int:
        lru = self._lrus.get(replica)
        return len(lru) if lru is not None else 0

    @property
    def total_blocks(self) -> int:
        return sum(len(lru) for lru in self._lrus.values())
