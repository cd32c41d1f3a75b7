"""Sequence-number bookkeeping of one event stream (pure: the intake thread drives it).

Publishers number batches 0, 1, 2, ... from their start. What a received number means:

* ``next``: the one after the last seen, nothing lost;
* ``first``: the first since subscribing (or reconnecting without a replay to tell);
* ``gap``: later than the next one, batches were lost in between (slow subscriber past
  the high-water mark, a network blip);
* ``reset``: lower than expected and not a replay duplicate: a new publisher (the engine
  restarted, with an empty cache and numbering from 0 again);
* ``dup``: already delivered, by a replay that overtook the live stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Verdict = Literal["next", "first", "gap", "reset", "dup"]


@dataclass(slots=True)
class SeqTracker:
    last: int | None = None
    # Highest number delivered by the last replay: live copies up to it are duplicates.
    replayed_upto: int = -1
    # Digest of the last batch, to tell after a reconnect whether the publisher is the same.
    last_digest: int = 0

    def classify(self, seq: int) -> Verdict:
        if seq <= self.replayed_upto and self.last is not None and seq <= self.last:
            return "dup"
        if self.last is None:
            return "first"
        if seq == self.last + 1:
            return "next"
        if seq > self.last + 1:
            return "gap"
        return "reset"

    def advance(self, seq: int, digest: int) -> None:
        self.last = seq
        self.last_digest = digest
        if seq > self.replayed_upto:
            self.replayed_upto = -1
