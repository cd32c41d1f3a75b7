"""How hard each replica's KV cache is being churned: what a recomputed token really costs.

A token a new session computes on replica r costs r's prefill (1) and, where another
replica already holds it, the cluster's lost work spread over the n replicas (1/n). That
is the whole cost while r's KV keeps what returning sessions need. Once it does not, every
copied token evicts one that another session comes back for, and co-locating by prefix is
what keeps the cluster from caching the same prefix n times: there a recomputed token
weighs the configured ``cache_weight`` (16, measured on the KV-bound Mooncake window).

Pressure, per replica, is the uncached prefill the gateway sent it over the last
``GAPS`` mean gaps between a session's requests (an exponential decay with that time
constant), over the KV its cache has, capped at 1: below 1 an LRU keeps what a returning
session needs. The caller passes that room: the KV capacity less what running requests
hold (the engine's KV usage), so long contexts in flight raise the pressure too. The gap
is measured from placements (a live session's next request); until one is measured the
pressure is 1, so nothing changes before the policy knows the traffic.

O(1) per dispatch and per replica asked; no timers.
"""

from __future__ import annotations

import math

from gateway.types import ReplicaId

# Mean gaps between a session's requests the intake is summed over. The mean gap is
# dominated by quick follow-ups while the prefixes at risk belong to sessions away
# longer: over one gap the Mooncake windows lost 0.4 points of hit and 1.3 s of p99
# against eight in `kvgate simulate` (docs/routing.md, issue 45, fourth).
GAPS = 8.0
_ALPHA = 0.05  # weight of one gap sample in the running mean


class KvPressure:
    __slots__ = ("_at", "_gap", "_intake")

    def __init__(self) -> None:
        self._intake: dict[ReplicaId, float] = {}
        self._at: dict[ReplicaId, float] = {}
        self._gap: float | None = None

    @property
    def mean_gap_s(self) -> float | None:
        """The running mean gap between a live session's requests, or None before one."""
        return self._gap

    def gap(self, seconds: float) -> None:
        """A live session came back after `seconds`."""
        if seconds < 0:
            return
        if self._gap is None:
            self._gap = seconds
        else:
            self._gap += _ALPHA * (seconds - self._gap)

    def _decayed(self, replica: ReplicaId, now: float) -> float:
        intake = self._intake.get(replica, 0.0)
        if not intake or not self._gap:
            return intake
        elapsed = now - self._at.get(replica, now)
        return intake * math.exp(-elapsed / (GAPS * self._gap)) if elapsed > 0 else intake

    def sent(self, replica: ReplicaId, tokens: float, now: float) -> None:
        """`tokens` of uncached prefill were sent to `replica` at `now`."""
        self._intake[replica] = self._decayed(replica, now) + tokens
        self._at[replica] = now

    def of(self, replica: ReplicaId, capacity_tokens: float, now: float) -> float:
        """Pressure in [0, 1]: 1 before any gap is measured or with no capacity known."""
        if self._gap is None or capacity_tokens <= 0:
            return 1.0
        return min(1.0, self._decayed(replica, now) / capacity_tokens)

    def forget(self, replica: ReplicaId) -> None:
        self._intake.pop(replica, None)
        self._at.pop(replica, None)


def token_weight(pressure: float, replicas: int, ceiling: float) -> float:
    """What one recomputed prompt token weighs against one queued: 1 + 1/n with no
    pressure, rising linearly to `ceiling` (the configured cache_weight) at full pressure.
    A ceiling below 1 + 1/n (a configuration that wants little cache pull) is kept."""
    floor = 1.0 + 1.0 / max(1, replicas)
    if ceiling <= floor:
        return ceiling
    return floor + (ceiling - floor) * pressure
