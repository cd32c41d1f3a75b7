"""What a batch changed in a replica's index, as the event loop needs it.

With the intake in its own process (gateway.kvevents.remote), that process keeps the whole
`EventIndex` (engine hashes, keys, chain links) and the gateway's loop only what a lookup
reads: each key's media bits, the replica's hole count and blocks per medium. After each
batch the intake process sends an `IndexDelta`: the keys whose bits changed, packed as
machine integers, so that the loop applies a new 20K-token prompt's 1250 stored and 1250
evicted blocks with two C-level dict passes instead of decoding, keying and linking them.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

from gateway.kvevents.index import EventIndex
from gateway.kvevents.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event
from gateway.types import ReplicaId


@dataclass(frozen=True, slots=True)
class IndexDelta:
    """`cleared`: start the replica over first. `set_keys`/`set_bits`: keys (array "Q") and
    their media bits now (array "B"); `gone`: keys no longer held (array "Q"). The rest are
    the replica's figures after the batch."""

    cleared: bool
    set_keys: bytes
    set_bits: bytes
    gone: bytes
    holes: int
    by_medium: dict[int, int]
    orphans: int
    skipped: int
    block_size: int
    # For the metrics: events of each kind in the batch, and its publication time.
    stored: int = 0
    removed: int = 0
    clears: int = 0
    ts: float = 0.0


def _note_keys(
    index: EventIndex, replica: ReplicaId, hashes: Sequence[BlockHash], into: set[int]
) -> None:
    r = index.blocks(replica)
    if r is not None:
        into.update(k for k in map(r.keys.get, hashes) if k is not None)


def apply_tracked(
    index: EventIndex, replica: ReplicaId, events: Sequence[Event], ts: float = 0.0
) -> IndexDelta:
    """Apply `events` to `index` (the intake process's whole one) and return what changed."""
    last_clear = max(
        (i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared)), default=-1
    )
    if last_clear >= 0:
        index.apply(replica, events[: last_clear + 1])  # whatever came before is moot
    touched: set[int] = set()
    index.journal = touched
    try:
        for event in events[last_clear + 1 :]:
            # A removal's keys are looked up before it forgets them, a store's after.
            if isinstance(event, BlockRemoved):
                _note_keys(index, replica, event.block_hashes, touched)
            index.apply(replica, (event,))
            if isinstance(event, BlockStored):
                _note_keys(index, replica, event.block_hashes, touched)
    finally:
        index.journal = None
    r = index.blocks(replica)
    if r is None:
        index.clear(replica)
        r = index.blocks(replica)
        assert r is not None
    keys = list(touched)
    bits = list(map(r.media.get, keys, repeat(0)))
    held = [(k, b) for k, b in zip(keys, bits, strict=True) if b]
    return IndexDelta(
        cleared=last_clear >= 0,
        set_keys=array("Q", [k for k, _ in held]).tobytes(),
        set_bits=array("B", [b for _, b in held]).tobytes(),
        gone=array("Q", [k for k, b in zip(keys, bits, strict=True) if not b]).tobytes(),
        holes=r.holes,
        by_medium={b: n for b, n in r.by_medium.items() if n},
        orphans=r.orphans,
        skipped=r.skipped,
        block_size=r.block_size,
        stored=sum(isinstance(e, BlockStored) for e in events),
        removed=sum(isinstance(e, BlockRemoved) for e in events),
        clears=sum(isinstance(e, AllBlocksCleared) for e in events),
        ts=ts,
    )
