"""`PromptBridge`: from the gateway's prompt hashes to the engines' token blocks.

Routing sees a request as chained hashes of its canonical byte stream (gateway.keys), never
as token ids: tokenizing on the event loop would cost more than the rest of the request
path. The tokenizer stage (gateway.kvevents.stage) tokenizes prompts in a worker thread
after their requests finished, and teaches the bridge, for each prompt block hash, the
token-block keys (gateway.kvevents.tokenkeys) that the bytes up to that block determine.
A later turn of the conversation repeats those leading bytes, hence those hashes: its
lookup finds the token blocks of everything up to the previous turn without tokenizing.

Memory: one entry per learnt prompt block (a shared key array per prompt). Bounded LRU.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

# How far back from a prompt's last hash to look one by one before a binary search: a new
# turn usually adds a block or two to what the bridge learnt from the previous one.
_LINEAR_PROBES = 8


class PromptBridge:
    def __init__(self, max_entries: int = 500_000) -> None:
        self.max_entries = max_entries
        self._map: OrderedDict[int, tuple[array[int], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def learn(self, prompt_hashes: Sequence[int], keys: array[int], counts: Sequence[int]) -> None:
        """`counts[j]`: how many leading entries of `keys` the bytes up to prompt block j
        determine (0 entries are not stored)."""
        m = self._map
        for h, n in zip(prompt_hashes, counts, strict=False):
            if n <= 0:
                continue
            m[h] = (keys, min(n, len(keys)))
            m.move_to_end(h)
        while len(m) > self.max_entries:
            m.popitem(last=False)

    def knows(self, prompt_hash: int) -> bool:
        return prompt_hash in self._map

    def known_blocks(self, prompt_hashes: Sequence[int]) -> int:
        """How many leading blocks of the prompt the longest learnt part covers."""
        return self._longest(prompt_hashes) + 1

    def lookup(self, prompt_hashes: Sequence[int]) -> tuple[array[int], int] | None:
        """(token-block keys, how many of them) for the longest learnt leading part of the
        prompt, or None when not even its first block was learnt."""
        found = self._longest(prompt_hashes)
        return self._map[prompt_hashes[found]] if found >= 0 else None

    def _longest(self, prompt_hashes: Sequence[int]) -> int:
        """Index of the deepest learnt prompt hash, or -1."""
        m = self._map
        n = len(prompt_hashes)
        for j in range(n - 1, max(-1, n - 1 - _LINEAR_PROBES), -1):
            if prompt_hashes[j] in m:
                return j
        lo, hi = 0, n - 1 - _LINEAR_PROBES
        found = -1
        while lo <= hi:
            mid = (lo + hi) // 2
            if prompt_hashes[mid] in m:
                found, lo = mid, mid + 1
            else:
                hi = mid - 1
        return found
