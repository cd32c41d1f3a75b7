"""`fold_history`: a replayed event history without the stores that it later undoes.

Joining an engine replays its whole buffer (vLLM keeps 10,000 batches): every prompt it
served, stored and then evicted. Applying all of it costs the event loop about a
microsecond a block, a second or more for a busy engine, to reach a state that holds
a small part of those blocks. The intake thread folds the history first, with set
operations in C: a store all of whose blocks a later removal takes away (and which no
kept store chains onto) is left out. What the index holds once the folded history is
applied is what the whole history would have left, except that its bound
(`max_blocks_per_replica`) is less often reached on the way.

Only the common case is folded: GPU stores and removals of KV cache group 0. Events of
other tiers or groups, and every removal, are kept as they are (a removal of a block the
index does not hold is a no-op). A clear makes everything before it moot.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.kvevents.wire import (
    GPU,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
)


def _plain(medium: str | None, group: int | None) -> bool:
    return (medium is None or medium == GPU) and not group


def fold_history(batches: Sequence[EventBatch]) -> list[EventBatch]:
    """`batches` (in order) with the stores the history undoes taken out of their events;
    one batch out per batch in, so that sequence numbers still line up."""
    dead: set[BlockHash] = set()  # removed later from the GPU, not stored again since
    needed: set[BlockHash] = set()  # parents of kept stores, not yet met going back
    cleared = False
    out: list[EventBatch] = []
    for batch in reversed(batches):
        kept: list[Event] = []
        for event in reversed(batch.events):
            if cleared:
                break
            if isinstance(event, AllBlocksCleared):
                cleared = True
                kept.append(event)
            elif isinstance(event, BlockRemoved):
                if _plain(event.medium, event.group_idx):
                    dead.update(event.block_hashes)
                kept.append(event)
            elif isinstance(event, BlockStored):
                hashes = event.block_hashes
                plain = _plain(event.medium, event.group_idx)
                if plain and dead.issuperset(hashes) and needed.isdisjoint(hashes):
                    continue  # gone by the end, and nothing kept hangs from it
                kept.append(event)
                if plain:
                    dead.difference_update(hashes)
                needed.difference_update(hashes)
                if event.parent_block_hash is not None:
                    needed.add(event.parent_block_hash)
            else:
                kept.append(event)
        if len(kept) == len(batch.events):
            out.append(batch)
        else:
            kept.reverse()
            out.append(EventBatch(batch.ts, tuple(kept), batch.dp_rank))
    out.reverse()
    return out
