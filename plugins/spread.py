"""New sessions that open with a prefix other sessions opened with: spread or follow.

`lineage` (plugins/lineage.py) places a new session by cost, and a high ``cache_weight``
makes it follow its cached prefix. That is right for a fork of one conversation (the
cluster saves its prefill) and wrong for an agent kind's shared preamble, which would pull
every new session of the kind onto the replica that cached it first. This module holds
what tells the two apart, measured from the policy's own placements:

* **Hot preambles spread.** `BranchPoints` counts new sessions per branch point (the last
  cached hash they opened with); once ``hot_after`` have branched there, the prefix is
  a shared preamble and a new session from it goes only to the replicas `band` admits:
  those whose load score (live sessions over their mean, plus those sessions' latest
  prompt tokens, what their next turns send, over their mean) is within
  ``2 x session_band`` of the lowest. Hot preambles spread, hot sessions stay.
* **Deep prefixes pull.** A hot branch point is not always a preamble: four forks of one
  conversation, or a parent resuming after them, branch at its whole history, held by one
  replica. What tells them apart is the depth the band would throw away (`beyond_common`):
  the prefix the best replica holds beyond what most replicas hold (a preamble every
  replica holds costs nothing to spread). The band is worth it while that is at most what
  a new session will send later (`SessionTraffic.owed`: its expected further turns times a
  continued turn's uncached prefill). Deeper than that, the policy lets the request follow
  the prefix unless its replica's queue says otherwise (`Lineage._deep`). Until a
  continued turn has been seen nothing is measured and the band decides alone.

No clocks and no I/O: counters updated at placement, read at decision time.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

from gateway.types import ReplicaId, ReplicaState

# Memory of the requests-per-session counts, per request: the last few thousand weigh.
_COUNT_MEMORY = 1.0 - 1.0 / 4096


class SessionTraffic:
    """Requests per new session and a continued turn's uncached prefill, from placements."""

    __slots__ = ("_alpha", "_new_sessions", "_requests", "_turn_tokens")

    def __init__(self, alpha: float) -> None:
        self._alpha = alpha  # weight of one continued turn in the running mean
        # Decayed counts of requests and of new sessions (their ratio: requests per session).
        self._requests = 0.0
        self._new_sessions = 0.0
        self._turn_tokens: float | None = None

    def new_session(self) -> None:
        keep = _COUNT_MEMORY
        self._requests = self._requests * keep + 1.0
        self._new_sessions = self._new_sessions * keep + 1.0

    def continued(self, turn_tokens: float | None) -> None:
        """A live session's request; `turn_tokens`, its uncached prefill where it stayed on
        its replica (None where it moved or carries no prefix: not a continued turn's cost)."""
        keep = _COUNT_MEMORY
        self._requests = self._requests * keep + 1.0
        self._new_sessions *= keep
        if turn_tokens is None:
            return
        if self._turn_tokens is None:
            self._turn_tokens = turn_tokens
        else:
            self._turn_tokens += self._alpha * (turn_tokens - self._turn_tokens)

    def owed(self) -> float | None:
        """Tokens a new session is expected to send after its first request (its further
        turns' uncached prefill), or None before any continued turn was measured."""
        if self._turn_tokens is None or self._new_sessions <= 0:
            return None
        turns = self._requests / self._new_sessions
        return max(0.0, turns - 1.0) * self._turn_tokens


class BranchPoints:
    """New sessions per branch point (the last cached hash they opened with), LRU-bounded."""

    __slots__ = ("_counts", "_limit")

    def __init__(self, limit: int) -> None:
        self._counts: OrderedDict[int, int] = OrderedDict()
        self._limit = limit

    def opened(self, hashes: Sequence[int], depth: int) -> None:
        """A new session opened with `hashes`, of which `depth` blocks were cached."""
        if depth <= 0:
            return
        counts, point = self._counts, hashes[depth - 1]
        counts[point] = counts.pop(point, 0) + 1
        if len(counts) > self._limit:
            counts.popitem(last=False)

    def sessions_at(self, hashes: Sequence[int], depth: int) -> int:
        """New sessions that branched where the first `depth` blocks of `hashes` end."""
        return self._counts.get(hashes[depth - 1], 0) if depth > 0 else 0


def band(
    replicas: Sequence[ReplicaState],
    live: Sequence[int],
    mass: Sequence[float],
    session_band: float,
) -> frozenset[ReplicaId]:
    """The replicas a new session from a hot prefix may go to: live sessions (`live`) and
    their context tokens (`mass`) per replica, in the order of `replicas`.

    The band is on both together: sessions alone let a few long conversations pile onto
    one replica (its token volume and KV pressure then run far ahead), tokens alone let
    many young ones pile up. Two separate bands can leave no replica in both.
    """
    n = len(replicas)
    # One dimensionless score, each count over its mean. The band is at least one
    # session's worth on each ratio: at light load a share of the mean admits no one.
    mean_live = max(1.0, sum(live) / n)
    mean_mass = max(1.0, sum(mass) / n)
    score = [c / mean_live + m / mean_mass for c, m in zip(live, mass, strict=True)]
    cap = min(score) + max(2.0 / mean_live, 2.0 * session_band)
    return frozenset(r.id for r, x in zip(replicas, score, strict=True) if x <= cap)


def beyond_common(cached: Sequence[int]) -> tuple[int, int]:
    """(index of the replica holding the most of the prompt, the tokens it holds beyond
    what a majority of replicas hold): the prefix spreading would recompute."""
    majority = len(cached) // 2 + 1
    common = heapq.nlargest(majority, cached)[-1]
    best = max(cached)
    return cached.index(best), best - common
