"""`Rechunker`: one stream's events re-cut from the engine's page size to kvgate's block size.

Prompts are keyed once, at `kv_events.block_size` (gateway.kvevents.tokenkeys); an engine
that pages at another size (SGLang's default `--page-size 1`, a vLLM at `--block-size 32`)
would publish blocks no prompt key can equal. Both engines' `BlockStored` carry the token
ids, so the intake thread cuts each replica's pages into kvgate blocks as they arrive:

* a page's tokens continue the tokens of its parent page; a kvgate block is complete when
  its last token arrives, whichever page carries it, and is then stored with a hash of
  its own (its key), chained on the kvgate block before it;
* a kvgate block is held on a tier while every engine page covering it is held there, so
  removing any one of them (or moving it off that tier) removes the block;
* pages whose parent was never seen are left out (the index would count them orphans).

Memory: an entry per engine page (a 100K-token prompt at page size 1 is 100K entries,
as many as the engine's own event lists), bounded by `max_pages`: past it the oldest
pages are forgotten and the blocks they covered removed (an under-count, never a claim).
Pure and single-threaded (the intake thread owns it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from gateway.kvevents.index import MEDIUM_BITS
from gateway.kvevents.tokenkeys import block_namespace, chain_keys, in_namespace, root_seed
from gateway.kvevents.wire import (
    GPU,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
)

MAX_PAGES = 1 << 22


@dataclass(slots=True)
class _Seg:
    """The pages of one stored event (from the first one whose hash was new) and the
    kvgate blocks completed by them. Offsets count from the last kvgate block boundary
    before the event: its first `c` tokens are the parent's leftover (`carry` pages)."""

    base: BlockHash | None  # hash of the kvgate block before (None: chain root)
    seed: int  # plain chain key before (root seed at the root)
    carry: tuple[BlockHash, ...]
    c: int
    p: int
    hashes: tuple[BlockHash, ...]
    tokens: list[int]
    extras: tuple[Any, ...] | None  # per own page
    blocks: list[BlockHash] = field(default_factory=list)
    plains: list[int] = field(default_factory=list)  # their plain chain keys (seeds)
    bits: list[int] = field(default_factory=list)  # tiers each block was stored on
    event: BlockStored | None = None  # names, group and kind of the events it emits


def _bit_names() -> dict[int, str]:
    names: dict[int, str] = {}
    for name, bit in MEDIUM_BITS.items():
        names.setdefault(bit, name)
    return names


_NAMES = _bit_names()
_BITS = (1, 2, 4, 8, 16)


class Rechunker:
    def __init__(self, block_size: int, max_pages: int = MAX_PAGES) -> None:
        self.block_size = block_size
        self.max_pages = max_pages
        # engine page hash -> [segment, page index in it, tier bits held]
        self._pages: dict[BlockHash, list[Any]] = {}
        # page hash -> segments whose carry it is part of
        self._carried: dict[BlockHash, list[_Seg]] = {}
        self._medium: dict[int, str] = dict(_NAMES)  # bit -> medium name to emit
        self.orphans = 0
        self.skipped = 0

    def __len__(self) -> int:
        return len(self._pages)

    def clear(self) -> None:
        self._pages.clear()
        self._carried.clear()

    def batch(self, batch: EventBatch) -> EventBatch:
        out: list[Event] = []
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event, out)
            elif isinstance(event, BlockRemoved):
                self._removed(event, out)
            else:
                self.clear()
                out.append(event)
        if len(self._pages) > self.max_pages:
            old = list(islice(self._pages, len(self._pages) - self.max_pages))
            self._forget(old, out)
        return EventBatch(batch.ts, tuple(out), batch.dp_rank)

    # -- stores ------------------------------------------------------------------------------
    def _bit(self, medium: str | None) -> int:
        name = medium or GPU
        bit = MEDIUM_BITS.get(name, 8)
        self._medium.setdefault(bit, name)
        return bit

    def _stored(self, e: BlockStored, out: list[Event]) -> None:
        n, p = len(e.block_hashes), e.block_size
        if len(e.token_ids) != n * p:
            self.skipped += n
            return
        bit = self._bit(e.medium)
        pages = self._pages
        j = 0
        while j < n and e.block_hashes[j] in pages:  # held already: on one more tier
            self._gained(e.block_hashes[j], bit, out)
            j += 1
        if j == n:
            return
        parent = e.block_hashes[j - 1] if j else e.parent_block_hash
        base: BlockHash | None
        carry: tuple[BlockHash, ...]
        carry_tokens: list[int]
        if parent is None:
            base, seed, carry, carry_tokens = None, root_seed(), (), []
        elif parent in pages:
            base, seed, carry, carry_tokens = self._tail(parent)
        else:
            self.orphans += n - j
            return
        extras = None
        if e.extra_keys is not None and any(x is not None for x in e.extra_keys[j:]):
            extras = tuple(islice(e.extra_keys, j, None))
        seg = _Seg(
            base,
            seed,
            carry,
            len(carry_tokens),
            p,
            tuple(e.block_hashes[j:]),
            carry_tokens + list(e.token_ids[j * p :]),
            extras,
            event=e,
        )
        for h in carry:
            self._carried.setdefault(h, []).append(seg)
        for i, h in enumerate(seg.hashes):
            pages[h] = [seg, i, bit]
        self._complete(seg, e)
        # The blocks completed, on this tier where every page covering them is on it.
        first, run = 0, 0
        for k in range(len(seg.blocks)):
            held = self._held(seg, k)
            if held & bit:
                seg.bits[k] = bit
                run += 1
                continue
            if run:
                out.append(self._emit(seg, first, first + run, bit))
            first, run = k + 1, 0
        if run:
            out.append(self._emit(seg, first, first + run, bit))

    def _tail(self, h: BlockHash) -> tuple[BlockHash | None, int, tuple[BlockHash, ...], list[int]]:
        """What follows page `h`: the kvgate block before its leftover tokens (hash and
        plain key), the pages covering that leftover, and the leftover tokens."""
        seg, i, _ = self._pages[h]
        B = self.block_size
        end = seg.c + (i + 1) * seg.p
        full = end // B
        if full:
            base, seed = seg.blocks[full - 1], seg.plains[full - 1]
        else:
            base, seed = seg.base, seg.seed
        start = full * B
        if start == end:
            return base, seed, (), []
        if start < seg.c:
            covering = seg.carry + seg.hashes[: i + 1]
        else:
            covering = seg.hashes[(start - seg.c) // seg.p : i + 1]
        return base, seed, covering, seg.tokens[start:end]

    def _complete(self, seg: _Seg, e: BlockStored) -> None:
        B = self.block_size
        count = len(seg.tokens) // B
        if not count:
            return
        extras = None
        if seg.extras is not None or any(self._extra(h) is not None for h in seg.carry):
            extras = [self._block_extra(seg, k) for k in range(count)]
        plain = chain_keys(seg.tokens[: count * B], B, seg.seed, extras)
        if e.lora_name is not None or e.cache_salt is not None or e.lora_id is not None:
            keys = in_namespace(plain, block_namespace(e))
        else:
            keys = plain
        seg.plains = plain
        seg.blocks = list(keys)
        seg.bits = [0] * count

    def _extra(self, h: BlockHash) -> Any:
        loc = self._pages.get(h)
        if loc is None or loc[0].extras is None:
            return None
        extras = loc[0].extras
        return extras[loc[1]] if loc[1] < len(extras) else None

    def _block_extra(self, seg: _Seg, k: int) -> Any:
        found = [x for x in map(self._extra, self._covering(seg, k)) if x is not None]
        return found or None

    def _covering(self, seg: _Seg, k: int) -> Iterable[BlockHash]:
        B = self.block_size
        lo = max(k * B, seg.c) - seg.c
        hi = (k + 1) * B - 1 - seg.c
        own = seg.hashes[lo // seg.p : hi // seg.p + 1] if hi >= 0 else ()
        return (seg.carry + own) if k == 0 and seg.c else own

    def _held(self, seg: _Seg, k: int) -> int:
        bits = -1
        pages = self._pages
        for h in self._covering(seg, k):
            loc = pages.get(h)
            bits &= loc[2] if loc is not None else 0
            if not bits:
                return 0
        return bits if bits != -1 else 0

    def _emit(self, seg: _Seg, lo: int, hi: int, bit: int) -> BlockStored:
        e = seg.event
        assert e is not None
        B = self.block_size
        extras = None
        if seg.extras is not None or (lo == 0 and seg.c):
            found = [self._block_extra(seg, k) for k in range(lo, hi)]
            extras = tuple(found) if any(x is not None for x in found) else None
        return BlockStored(
            tuple(seg.blocks[lo:hi]),
            seg.blocks[lo - 1] if lo else seg.base,
            tuple(seg.tokens[lo * B : hi * B]),
            B,
            e.lora_id,
            self._medium.get(bit, GPU),
            extras,
            e.group_idx,
            e.lora_name,
            e.cache_salt,
            e.spec_kind,
        )

    def _blocks_of(self, h: BlockHash) -> list[tuple[_Seg, int]]:
        """The completed kvgate blocks page `h` covers part of."""
        loc = self._pages.get(h)
        out: list[tuple[_Seg, int]] = []
        if loc is not None:
            seg, i = loc[0], loc[1]
            B = self.block_size
            start = seg.c + i * seg.p
            for k in range(start // B, min((start + seg.p - 1) // B + 1, len(seg.blocks))):
                out.append((seg, k))
        for child in self._carried.get(h, ()):
            if child.blocks:
                out.append((child, 0))
        return out

    def _gained(self, h: BlockHash, bit: int, out: list[Event]) -> None:
        loc = self._pages[h]
        if loc[2] & bit:
            return
        loc[2] |= bit
        for seg, k in self._blocks_of(h):
            if not seg.bits[k] & bit and self._held(seg, k) & bit:
                seg.bits[k] |= bit
                out.append(self._emit(seg, k, k + 1, bit))

    # -- removals ----------------------------------------------------------------------------
    def _removed(self, e: BlockRemoved, out: list[Event]) -> None:
        bit = self._bit(e.medium)
        gone: list[BlockHash] = []
        unknown: list[BlockHash] = []
        for h in e.block_hashes:
            loc = self._pages.get(h)
            if loc is None:
                unknown.append(h)
                continue
            self._lost(h, bit, gone)
            loc[2] &= ~bit
            if not loc[2]:
                self._drop(h)
        if gone:
            out.append(BlockRemoved(tuple(gone), self._medium.get(bit, GPU), e.group_idx))
        if unknown:  # stores from before this stream was re-cut: the index may hold them
            out.append(BlockRemoved(tuple(unknown), e.medium, e.group_idx))

    def _lost(self, h: BlockHash, bit: int, gone: list[BlockHash]) -> None:
        for seg, k in self._blocks_of(h):
            if seg.bits[k] & bit:
                seg.bits[k] &= ~bit
                gone.append(seg.blocks[k])

    def _drop(self, h: BlockHash) -> None:
        self._pages.pop(h, None)
        self._carried.pop(h, None)

    def _forget(self, hashes: Sequence[BlockHash], out: list[Event]) -> None:
        by_bit: dict[int, list[BlockHash]] = {}
        for h in hashes:
            loc = self._pages.get(h)
            if loc is None:
                continue
            for bit in _BITS:
                if loc[2] & bit:
                    self._lost(h, bit, by_bit.setdefault(bit, []))
            self._drop(h)
        for bit, gone in by_bit.items():
            if gone:
                out.append(BlockRemoved(tuple(gone), self._medium.get(bit, GPU)))
