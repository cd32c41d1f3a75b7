"""Incremental tokenization: a rendered prompt that extends one tokenized before reuses its
token ids and tokenizes only the rest (the next turn of a conversation, another session
with the same preamble).

The two texts agree up to the end of the last chunk they share (gateway.kvevents.tokcache).
A subword tokenizer may merge across any cut, and a token near the end of the shared text
may have been formed with the earlier prompt's continuation, so the cut is made well before
it: `GUARD_CHARS` back from the end of the agreement, then `OVERLAP_TOKENS` more tokens
back, at a token that starts with whitespace after a non-space (where pre-tokenizers split).
The text from the cut on is tokenized alone and must reproduce the earlier prompt's tokens
over the overlap, ending on the same boundary; if it does not (a tokenizer whose pieces
depend on more context, one that marks the start of its input), the whole prompt is
tokenized instead. Token-block keys of the reused blocks are reused too.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.kvevents.tokcache import CHUNK_CHARS, Entry, TokenCache, chunk_hashes
from gateway.kvevents.tokenkeys import chain_keys, root_seed

GUARD_CHARS = 256
OVERLAP_TOKENS = 16
_ANCHOR_SEARCH = 64  # tokens further back to look for a whitespace boundary

# A tokenizer: (text, add the special tokens of a whole input?) -> (ids, where each ends).
Encode = Callable[[str, bool], tuple[Sequence[int], Sequence[int]]]


@dataclass(frozen=True, slots=True)
class Encoded:
    ids: Sequence[int]
    ends: Sequence[int]
    keys: Sequence[int] | None = None  # token-block keys, when the encoder computed them
    reuse: str = ""  # "hit", "miss", "fallback"; "" without a cache
    reused: int = 0  # leading tokens taken from the cache


def plain(encode: Encode) -> Callable[[str, bool], Encoded]:
    def run(text: str, specials: bool) -> Encoded:
        ids, ends = encode(text, specials)
        return Encoded(ids, ends)

    return run


def _ids_array(ids: Sequence[int]) -> array[int]:
    try:
        return array("I", ids)
    except OverflowError:
        return array("q", ids)


class IncrementalEncoder:
    def __init__(self, encode: Encode, cache: TokenCache, block_size: int) -> None:
        self.encode = encode
        self.cache = cache
        self.block_size = block_size
        self.seed = root_seed()

    def __call__(self, text: str, specials: bool) -> Encoded:
        hashes = chunk_hashes(text)
        found = self.cache.find(hashes)
        outcome = "miss"
        if found is not None:
            entry, shared = found
            # Every hash of an entry this text fully extends now names the new entry.
            replaces = entry if shared == len(entry.hashes) else None
            enc = self._extend(text, entry, shared * CHUNK_CHARS)
            if enc is not None:
                ids, ends, keys, reused = enc
                self.cache.put(Entry(tuple(hashes), ids, ends, keys), replaces)
                return Encoded(ids, ends, keys, "hit", reused)
            outcome = "fallback"
        else:
            replaces = None
        raw_ids, raw_ends = self.encode(text, specials)
        ids = _ids_array(raw_ids)
        ends = array("q", raw_ends)
        keys = array("Q", chain_keys(ids, self.block_size, self.seed))
        self.cache.put(Entry(tuple(hashes), ids, ends, keys), replaces)
        return Encoded(ids, ends, keys, outcome, 0)

    def _anchor(self, text: str, ends: array[int], last: int) -> int:
        """A token index <= `last` to cut before: preferably one starting a word."""
        for i in range(last, max(0, last - _ANCHOR_SEARCH), -1):
            c = ends[i - 1]
            starts_word = 0 < c < len(text) and text[c].isspace() and not text[c - 1].isspace()
            if starts_word and c < ends[i]:
                return i
        return last

    def _extend(
        self, text: str, entry: Entry, agreed: int
    ) -> tuple[array[int], array[int], array[int], int] | None:
        old_ids, old_ends = entry.ids, entry.ends
        k = min(bisect_right(old_ends, agreed - GUARD_CHARS), len(old_ids) - 1)
        k0 = self._anchor(text, old_ends, k - OVERLAP_TOKENS)
        if k0 < 1:
            return None
        cut = old_ends[k0 - 1]
        tail_ids, tail_ends = self.encode(text[cut:], False)
        m = k - k0
        if (
            len(tail_ids) <= m
            or list(tail_ids[:m]) != old_ids[k0:k].tolist()
            or tail_ends[m - 1] + cut != old_ends[k - 1]
        ):
            return None
        ids = old_ids[:k0]
        try:
            ids.extend(tail_ids)
        except OverflowError:
            return None
        ends = old_ends[:k0]
        ends.extend(e + cut for e in tail_ends)
        bs = self.block_size
        b = k0 // bs if ids.typecode == "I" else 0
        keys = entry.keys[:b]
        keys.extend(chain_keys(ids[b * bs :], bs, keys[-1] if b else self.seed))
        return ids, ends, keys, k0
