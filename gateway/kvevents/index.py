"""`EventIndex`: what each replica's KV cache holds, as its own events say, block by block.

Per replica: engine block hash -> the gateway's key for that block (tokenkeys), and key ->
the media holding it (a bit per tier: GPU, CPU offload, disk, ...). Fed on the event loop
by the intake (gateway.kvevents.intake); read by `CacheEvidence` during routing.

A stored block whose parent the index does not know cannot be keyed (its tokens alone do
not say where in a prompt it sits): it is counted as an orphan and left out, so the index
never claims more than the engine holds. Memory is bounded per replica: past
`max_blocks`, the oldest entries go first (they are the ones a lost removal left behind).

Lookup: O(log L) dict reads for an L-block prompt while the replica has no *hole* (a
held block whose parent is not held: the engine evicted a block but kept a later one of
its chain), since presence along a chain is then prefix-closed; O(m) for m matched blocks
otherwise, and when some blocks live on other tiers than the GPU (their weights differ).
vLLM frees a request's blocks tail first, so holes are rare and short-lived.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from itertools import filterfalse, islice, repeat
from typing import TYPE_CHECKING, cast

from gateway.kvevents.tokenkeys import block_namespace, chain_keys, in_namespace, root_seed
from gateway.kvevents.wire import GPU, AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event
from gateway.types import ReplicaId

if TYPE_CHECKING:
    from gateway.kvevents.delta import IndexDelta

# Media names as vLLM and SGLang spell them; anything else shares the last bit. vLLM's
# STORAGE (an offloading connector's tier) and SGLang's EXTERNAL (a shared pool such as
# Mooncake's) are the remote tier.
MEDIUM_BITS: Mapping[str, int] = {
    GPU: 1,
    "CPU": 2,
    "CPU_PINNED": 2,
    "DISK": 4,
    "STORAGE": 16,
    "EXTERNAL": 16,
}
_OTHER_BIT = 8
MEDIUM_NAMES: Mapping[int, str] = {1: "GPU", 2: "CPU", 4: "DISK", 16: "remote", 8: "other"}
# KV cache groups whose blocks hold every token of the prefix (vLLM's KVCacheSpecKind
# values): a sliding-window or Mamba group's blocks do not make a prefix hit on their own.
FULL_ATTENTION = frozenset(("full_attention", "mla_attention", "sink_full_attention"))


class SyncState(str, Enum):
    """How far a replica's index can be trusted.

    synced: every event since a known-empty cache (seq 0, a clear, a full replay) was seen;
    warming: events flow but some were lost (the index under-counts until `warmup_s`);
    down: no publisher connected, or never heard from.
    """

    SYNCED = "synced"
    WARMING = "warming"
    DOWN = "down"


def medium_bit(medium: str | None) -> int:
    return MEDIUM_BITS.get(medium or GPU, _OTHER_BIT)


@dataclass(slots=True)
class ReplicaBlocks:
    block_size: int = 0
    keys: dict[BlockHash, int] = field(default_factory=dict)  # engine hash -> key
    media: dict[int, int] = field(default_factory=dict)  # key -> medium bits
    by_medium: dict[int, int] = field(default_factory=dict)  # medium bit -> blocks
    parent: dict[int, int] = field(default_factory=dict)  # key -> parent key (chained ones)
    children: dict[int, int] = field(default_factory=dict)  # key -> held children
    holes: int = 0
    orphans: int = 0
    skipped: int = 0
    evicted: int = 0  # entries dropped from the front of `keys` since it was last compacted
    # The KV cache group indexed: the first full-attention one the events name (None: none
    # named yet, so group 0, as engines without hybrid groups publish).
    group: int | None = None
    # Namespaced key -> its plain chain key (salted or adapter blocks), to chain children.
    plain: dict[int, int] = field(default_factory=dict)


class EventIndex:
    """See the module docstring. `version` grows on every change (lookup memos key on it)."""

    def __init__(self, max_blocks: int = 1 << 21, group: int | None = None) -> None:
        self.max_blocks = max_blocks
        # Only this KV cache group is indexed (hybrid models publish one per attention
        # kind); None: each replica's first full-attention group (see ReplicaBlocks.group).
        self.group = group
        self._replicas: dict[ReplicaId, ReplicaBlocks] = {}
        self.version = 0
        # When set, keys the bound drops are added to it (gateway.kvevents.delta tracks what
        # a batch changed).
        self.journal: set[int] | None = None

    def replicas(self) -> Iterable[ReplicaId]:
        return self._replicas.keys()

    def blocks(self, replica: ReplicaId) -> ReplicaBlocks | None:
        return self._replicas.get(replica)

    def clear(self, replica: ReplicaId) -> None:
        self._replicas[replica] = ReplicaBlocks()
        self.version += 1

    def forget(self, replica: ReplicaId) -> None:
        self._replicas.pop(replica, None)
        self.version += 1

    def apply(self, replica: ReplicaId, events: Sequence[Event]) -> None:
        r = self._replicas.get(replica)
        if r is None:
            r = self._replicas[replica] = ReplicaBlocks()
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(r, event)
            elif isinstance(event, BlockRemoved):
                self._removed(r, event)
            elif isinstance(event, AllBlocksCleared):
                r = self._replicas[replica] = ReplicaBlocks(r.block_size, group=r.group)
        self.version += 1

    def apply_delta(self, replica: ReplicaId, d: IndexDelta) -> None:
        """What a batch changed, as the intake process computed it (gateway.kvevents.delta):
        this index then holds media, holes and counts only, which is all a lookup reads."""
        r = self._replicas.get(replica)
        if r is None or d.cleared:
            r = self._replicas[replica] = ReplicaBlocks(r.block_size if r is not None else 0)
        media = r.media
        media.update(zip(array("Q", d.set_keys), array("B", d.set_bits)))
        deque(map(media.pop, array("Q", d.gone), repeat(None)), 0)
        r.holes, r.orphans, r.skipped = d.holes, d.orphans, d.skipped
        r.by_medium = dict(d.by_medium)
        r.block_size = d.block_size
        self.version += 1

    def _wanted(self, r: ReplicaBlocks, group: int | None, kind: str | None = None) -> bool:
        if self.group is not None:
            return (group or 0) == self.group
        if kind is not None:
            if kind not in FULL_ATTENTION:
                return False
            if r.group is None:
                r.group = group or 0
        return (group or 0) == (r.group or 0)

    def _stored(self, r: ReplicaBlocks, e: BlockStored) -> None:
        if not self._wanted(r, e.group_idx, e.spec_kind):
            return
        n = len(e.block_hashes)
        if len(e.token_ids) != n * e.block_size:
            r.skipped += n
            return
        parent: int | None = None
        if e.parent_block_hash is None:
            seed = root_seed()
        else:
            parent = r.keys.get(e.parent_block_hash)
            if parent is None:
                r.orphans += n
                return
            seed = r.plain.get(parent, parent)
        r.block_size = e.block_size
        bit = medium_bit(e.medium)
        keys = r.keys
        chain = chain_keys(e.token_ids, e.block_size, seed, e.extra_keys, e.packed)
        if e.lora_name is not None or e.cache_salt is not None or e.lora_id is not None:
            # Keyed apart: a plain prompt never matches them (the engine would not hit).
            plain = chain
            chain = in_namespace(plain, block_namespace(e))
            r.plain.update(zip(chain, plain, strict=True))
        if not self._stored_fresh(r, e.block_hashes, chain, parent, bit):
            self._stored_each(r, e.block_hashes, chain, parent, bit)
        excess = len(keys) - self.max_blocks
        if excess > 0:
            self._evict(r, excess)

    def _evict(self, r: ReplicaBlocks, count: int) -> None:
        """Drop the `count` oldest entries. In one pass, and with `keys` copied once a
        quarter of it was dropped: a dict emptied from its front keeps the holes, and each
        scan from the front walks them (evicting one entry at a time took 46 ms an event at
        a 100,000-block bound)."""
        keys = r.keys
        journal = self.journal
        for old in list(islice(keys, count)):
            key = keys.pop(old)
            self._drop(r, old, key, -1)
            if journal is not None:
                journal.add(key)
        r.evicted += count
        if r.evicted > len(keys) // 4:
            r.keys = dict(keys)
            r.evicted = 0

    @staticmethod
    def _stored_fresh(
        r: ReplicaBlocks,
        hashes: Sequence[BlockHash],
        chain: list[int],
        parent: int | None,
        bit: int,
    ) -> bool:
        """The common case in bulk: a chain none of whose blocks or keys the replica holds,
        and no earlier child of which is waiting for it. What `_stored_each` would do, with
        the loops in C: the event of a new 20K-token prompt (1250 blocks) took 1.2 ms of
        the event loop, now 1.0, 0.4 of which keys its tokens. False, having changed
        nothing, otherwise."""
        keys, media, children = r.keys, r.media, r.children
        if not chain:
            return True
        if (
            any(map(keys.__contains__, hashes))
            or any(map(media.__contains__, chain))
            # A key not held has children only if one of them is a hole.
            or (r.holes and any(map(children.__contains__, chain)))
        ):
            return False
        # (A key twice in one chain would be a 64-bit collision of chained hashes: ignored.)
        keys.update(zip(hashes, chain))
        media.update(zip(chain, repeat(bit)))
        r.by_medium[bit] = r.by_medium.get(bit, 0) + len(chain)
        links = r.parent
        links.update(zip(chain[1:], chain))
        children.update(zip(chain[:-1], repeat(1)))
        if parent is not None:
            links[chain[0]] = parent
            children[parent] = children.get(parent, 0) + 1
            if parent not in media:
                r.holes += 1
        return True

    def _stored_each(
        self,
        r: ReplicaBlocks,
        hashes: Sequence[BlockHash],
        chain: list[int],
        parent: int | None,
        bit: int,
    ) -> None:
        keys, media, counts = r.keys, r.media, r.by_medium
        for h, key in zip(hashes, chain):
            keys.pop(h, None)  # re-insert: newest last, for the bound below
            keys[h] = key
            bits = media.get(key, 0)
            if not bits & bit:
                media[key] = bits | bit
                counts[bit] = counts.get(bit, 0) + 1
                if not bits:
                    self._arrived(r, key, parent)
            parent = key

    def _removed(self, r: ReplicaBlocks, e: BlockRemoved) -> None:
        if not self._wanted(r, e.group_idx):
            return
        bit = medium_bit(e.medium)
        if len(e.block_hashes) > 1 and self._removed_whole(r, e.block_hashes, bit):
            return
        for h in e.block_hashes:
            key = r.keys.get(h)
            if key is not None and self._drop(r, h, key, bit) == 0:
                del r.keys[h]

    @staticmethod
    def _removed_whole(r: ReplicaBlocks, hashes: Sequence[BlockHash], bit: int) -> bool:
        """The common removal in bulk: distinct blocks held on this tier only, which take
        all their held children with them (an engine freeing a request's blocks, or
        evicting them for a new prompt). What `_drop` block by block would do, with the
        loops over the blocks in C: a new 20K-token prompt's eviction of 1250 blocks cost
        the event loop about a millisecond that way. False, having changed nothing,
        otherwise."""
        keys, media, parent, children = r.keys, r.media, r.parent, r.children
        looked = list(map(keys.get, hashes))
        if None in looked:
            return False
        found = cast("list[int]", looked)
        gone = set(found)
        # (A hash listed twice lists its key twice: distinct keys mean distinct hashes.)
        if len(gone) != len(found):
            return False
        only_gpu = bit == 1 and not any(n for b, n in r.by_medium.items() if b != 1)
        if not only_gpu and not all(map(bit.__eq__, map(media.get, found))):
            return False  # (on a GPU-only replica every held key's bits are 1)
        parents = list(map(parent.get, found))
        inside = sum(map(gone.__contains__, parents))
        if sum(map(children.get, found, repeat(0))) != inside:
            return False  # a held child stays: it becomes a hole (block by block)
        # The parents of what goes that stay (each loses a child): few, found in C.
        for up in filterfalse(gone.__contains__, parents):
            if up is not None:
                if up not in media:
                    r.holes -= 1
                left = children.get(up, 0) - 1
                if left > 0:
                    children[up] = left
                else:
                    children.pop(up, None)
        deque(map(media.__delitem__, found), 0)
        deque(map(keys.__delitem__, hashes), 0)
        deque(map(parent.pop, found, repeat(None)), 0)
        deque(map(children.pop, found, repeat(None)), 0)
        if r.plain:
            deque(map(r.plain.pop, found, repeat(None)), 0)
        r.by_medium[bit] = r.by_medium.get(bit, len(found)) - len(found)
        return True

    @staticmethod
    def _arrived(r: ReplicaBlocks, key: int, parent: int | None) -> None:
        """`key` is held again: it fills the hole of its held children, and is a hole
        itself when its parent is not held."""
        r.holes -= r.children.get(key, 0)
        if parent is not None:
            r.parent[key] = parent
            r.children[parent] = r.children.get(parent, 0) + 1
            if parent not in r.media:
                r.holes += 1

    @staticmethod
    def _gone(r: ReplicaBlocks, key: int) -> None:
        if r.plain:
            r.plain.pop(key, None)
        parent = r.parent.pop(key, None)
        if parent is not None:
            if parent not in r.media:
                r.holes -= 1
            left = r.children.get(parent, 0) - 1
            if left > 0:
                r.children[parent] = left
            else:
                r.children.pop(parent, None)
        r.holes += r.children.get(key, 0)

    def _drop(self, r: ReplicaBlocks, h: BlockHash, key: int, bit: int) -> int:
        """Clear `bit` (-1: every bit) of `key`; returns the bits left."""
        bits = r.media.get(key, 0)
        gone = bits & bit
        for b in MEDIUM_NAMES:
            if gone & b:
                r.by_medium[b] = r.by_medium.get(b, 1) - 1
        left = bits & ~gone
        if left:
            r.media[key] = left
        elif bits:
            del r.media[key]
            self._gone(r, key)
        return left

    def matched(
        self, replica: ReplicaId, keys: Sequence[int], weights: Mapping[int, float]
    ) -> tuple[int, float]:
        """(leading blocks of `keys` the replica holds, those blocks weighed by medium):
        a block's weight is that of the best medium holding it (`weights` by medium bit)."""
        r = self._replicas.get(replica)
        if r is None or not keys or keys[0] not in r.media:
            return 0, 0.0
        gpu_only = not any(n for b, n in r.by_medium.items() if b != 1)
        if r.holes == 0 and gpu_only:
            held = r.media
            lo, hi = 1, len(keys)  # keys[:lo] held; find the largest such lo
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if keys[mid - 1] in held:
                    lo = mid
                else:
                    hi = mid - 1
            return lo, lo * weights.get(1, 1.0)
        media = r.media.get
        n = 0
        weighed = 0.0
        last_bits, last_w = 1, weights.get(1, 1.0)
        for key in keys:
            bits = media(key)
            if not bits:
                break
            if bits != last_bits:
                last_bits = bits
                last_w = max((w for b, w in weights.items() if bits & b), default=0.0)
            n += 1
            weighed += last_w
        return n, weighed
