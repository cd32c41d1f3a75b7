"""`TokenCache`: token ids of rendered prompts already tokenized, found again by the chained
hashes of their leading text (gateway.kvevents.incremental).

A rendered prompt is cut into chunks of `CHUNK_CHARS` characters; chunk j's hash chains on
chunk j-1's, so one hash names the whole text up to the end of its chunk. Each entry keeps
the prompt's token ids, where each token ends in the text, and its token-block keys, and is
reachable from each of its full chunks' hashes. A later turn of a conversation repeats the
earlier turn's rendered text, hence its chunk hashes: the last one it shares names the entry
and how far the two texts agree.

Keyed by the rendered text, not the gateway's canonical prompt hashes (gateway.keys): the
template adds text between and after the messages, so canonical offsets do not map onto
rendered ones without the render, and the render is what the tokens are a function of.

Bounded by entries and by bytes, least recently used first. An entry the next turn fully
extends is replaced by it (one entry per conversation, not one per turn). Worker threads
share it: every method holds the lock.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

CHUNK_CHARS = 2048
_SEED = 0x7463_6863  # separates these hashes from the gateway's other xxh3 chains
_PER_CHUNK_BYTES = 120  # a dict slot and an int object, roughly
_xxh3 = xxhash.xxh3_64_intdigest


def chunk_hashes(text: str, chunk: int = CHUNK_CHARS) -> list[int]:
    """Chained hashes of the full `chunk`-character pieces of `text`."""
    out: list[int] = []
    h = _SEED
    for start in range(0, len(text) - chunk + 1, chunk):
        h = _xxh3(text[start : start + chunk].encode("utf-8", "surrogatepass"), h)
        out.append(h)
    return out


@dataclass(slots=True, eq=False)
class Entry:
    hashes: tuple[int, ...]
    ids: array[int]
    ends: array[int]  # character offset where each token ends in the rendered text
    keys: array[int]  # token-block keys of the full blocks of `ids`
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = (
            self.ids.itemsize * len(self.ids)
            + self.ends.itemsize * len(self.ends)
            + self.keys.itemsize * len(self.keys)
            + _PER_CHUNK_BYTES * len(self.hashes)
        )


@dataclass(slots=True)
class CacheStats:
    entries: int
    bytes: int
    evictions: int


class TokenCache:
    def __init__(self, max_entries: int = 1024, max_bytes: int = 256 << 20) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self.evictions = 0
        self._lru: OrderedDict[int, Entry] = OrderedDict()  # id(entry) -> entry
        self._by_hash: dict[int, Entry] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lru)

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(len(self._lru), self.bytes, self.evictions)

    def find(self, hashes: Sequence[int]) -> tuple[Entry, int] | None:
        """The entry sharing the most leading chunks with `hashes`, and how many it shares."""
        with self._lock:
            for j in range(len(hashes) - 1, -1, -1):
                entry = self._by_hash.get(hashes[j])
                if entry is not None:
                    self._lru.move_to_end(id(entry))
                    return entry, j + 1
        return None

    def put(self, entry: Entry, replaces: Entry | None = None) -> None:
        """Add `entry` (if it fits at all); drop `replaces`, an entry it extends."""
        with self._lock:
            if replaces is not None and self._lru.pop(id(replaces), None) is not None:
                self._forget(replaces)
            if not entry.hashes or entry.size > self.max_bytes:
                return
            self._lru[id(entry)] = entry
            self.bytes += entry.size
            for h in entry.hashes:
                self._by_hash[h] = entry
            while len(self._lru) > self.max_entries or self.bytes > self.max_bytes:
                _, oldest = self._lru.popitem(last=False)
                self._forget(oldest)
                self.evictions += 1

    def _forget(self, entry: Entry) -> None:
        self.bytes -= entry.size
        for h in entry.hashes:
            # A newer entry with the same leading text may have taken the hash over.
            if self._by_hash.get(h) is entry:
                del self._by_hash[h]
