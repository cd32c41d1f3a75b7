"""Approximate per-replica index of the prompt blocks recently sent to each replica.

Each replica has an LRU of chained block hashes whose size follows the replica's KV
capacity (in blocks), so the index forgets roughly what the engine's own cache evicts.
Blocks of a request are touched deepest-first, which leaves a prefix more recent than
its extensions: eviction then drops the tails of prompts first (as vLLM does), and the
set of a replica's blocks stays prefix-closed, so a binary search finds the match length.

Memory: one dict entry per indexed block plus one reverse-map entry per (block, replica).
Lookup: O(log L) per replica for an L-block prompt, O(1) for a replica that does not hold
the first block; `matched_sparse` finds all matches from the reverse map in O(g log L) set
intersections, g = number of distinct match lengths.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from gateway.hashing import leading_match
from gateway.types import ReplicaId

_NO_OWNER = ReplicaId("")  # a standalone LRU keeps no reverse map
# KV capacity of a replica that neither configures nor reports one (its index is sized from it).
DEFAULT_CAPACITY_TOKENS = 500_000


class BlockLRU:
    """One replica's blocks. With `holders` (shared by a `PrefixIndex`) it also keeps the
    reverse map block -> replicas holding it in step with its own additions and evictions."""

    __slots__ = ("_blocks", "_holders", "_owner", "capacity")

    def __init__(
        self,
        capacity: int,
        owner: ReplicaId = _NO_OWNER,
        holders: dict[int, ReplicaId | set[ReplicaId]] | None = None,
    ) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.capacity = max(1, capacity)
        self._owner = owner
        self._holders = holders

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def add(self, hashes: Sequence[int]) -> None:
        blocks = self._blocks
        holders = self._holders
        if holders is None:
            for h in reversed(hashes):
                if h in blocks:
                    blocks.move_to_end(h)
                else:
                    blocks[h] = None
        else:
            owner = self._owner
            touch, held_by = blocks.move_to_end, holders.get
            for h in reversed(hashes):
                if h in blocks:
                    touch(h)
                    continue
                blocks[h] = None
                held = held_by(h)
                if held is None:
                    holders[h] = owner
                elif isinstance(held, set):
                    held.add(owner)
                else:
                    holders[h] = {held, owner}
        self._trim()

    def resize(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._trim()

    def clear(self) -> None:
        self._drop(len(self._blocks))

    def _trim(self) -> None:
        excess = len(self._blocks) - self.capacity
        if excess > 0:
            self._drop(excess)

    def _drop(self, count: int) -> None:
        """Evict the `count` least recently used blocks."""
        blocks = self._blocks
        holders = self._holders
        if holders is None:
            for _ in range(count):
                blocks.popitem(last=False)
            return
        owner = self._owner
        pop, held_by = blocks.popitem, holders.get
        for _ in range(count):
            block = pop(False)[0]
            held = held_by(block)
            if isinstance(held, set):
                held.discard(owner)
                if len(held) == 1:
                    holders[block] = next(iter(held))
            elif held == owner:
                del holders[block]

    def matched(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks of `hashes` held here."""
        return leading_match(hashes, self._blocks)


class PrefixIndex:
    """One `BlockLRU` per replica, sized in blocks from each replica's capacity in tokens."""

    def __init__(self, default_capacity_tokens: int, capacity_factor: float = 1.0) -> None:
        self._default_tokens = default_capacity_tokens
        self._factor = capacity_factor
        self._capacity_tokens: dict[ReplicaId, int] = {}
        self._lrus: dict[ReplicaId, BlockLRU] = {}
        # block -> replicas holding it: a request's matches are found from its own blocks,
        # not by probing every replica.
        # (a bare id for a single holder, the usual case: a set per block costs ~200 bytes)
        self._holders: dict[int, ReplicaId | set[ReplicaId]] = {}

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
            lru = self._lrus[replica] = BlockLRU(
                self._blocks_for(replica, block_tokens), replica, self._holders
            )
        lru.add(hashes)

    def matched(self, replica: ReplicaId, hashes: Sequence[int]) -> int:
        lru = self._lrus.get(replica)
        return lru.matched(hashes) if lru is not None else 0

    def matched_sparse(
        self, position: Mapping[ReplicaId, int], hashes: Sequence[int]
    ) -> dict[int, int]:
        """{position[r]: matched(r)} for the replicas in `position` that hold the first
        block. Runs `BlockLRU.matched`'s binary search for all holders at once: holders that
        answer every probe alike share one probe (a set intersection), so the cost follows
        the number of distinct match lengths, not the number of replicas."""
        if not hashes:
            return {}
        first = self._holders.get(hashes[0])
        if first is None:
            return {}
        members: set[ReplicaId]
        if isinstance(first, set):
            members = {r for r in first if r in position}
        else:
            members = {first} if first in position else set()
        out: dict[int, int] = {}
        holders = self._holders
        empty: set[ReplicaId] = set()
        groups = [(1, len(hashes), members)] if members else []
        while groups:
            lo, hi, group = groups.pop()
            if lo >= hi:
                for r in group:
                    out[position[r]] = lo
                continue
            mid = (lo + hi + 1) // 2
            held = holders.get(hashes[mid - 1], empty)
            yes = group & held if isinstance(held, set) else {held} & group
            if yes:
                groups.append((mid, hi, yes))
            if len(yes) < len(group):
                groups.append((lo, mid - 1, group - yes))
        return out

    def forget(self, replica: ReplicaId) -> None:
        lru = self._lrus.pop(replica, None)
        if lru is not None:
            lru.clear()
        self._capacity_tokens.pop(replica, None)

    def size(self, replica: ReplicaId) -> int:
        lru = self._lrus.get(replica)
        return len(lru) if lru is not None else 0

    @property
    def total_blocks(self) -> int:
        return sum(len(lru) for lru in self._lrus.values())
