"""How fast each replica is overwriting its KV cache, from the prefill this gateway sends it.

Every uncached prompt token a replica prefills is written into its KV cache, and an engine
whose cache is full makes room by evicting its least recently used blocks. A replica that
writes more evicts sooner: a conversation placed there loses its prefix before its next
turn more often than on a replica that writes less. So the meter keeps, per replica, the
uncached tokens sent there, each decayed by how much the whole cluster has written since:
after the cluster has written its own KV capacity again, what was written before it is
mostly evicted everywhere and no longer tells replicas apart.

    churn_r = sum over r's writes w of  w.tokens * exp(-(cluster tokens written since w) / H)

with H the cluster's KV capacity in tokens. The clock is the cluster's writes, not
seconds, so a burst and a lull age what was written alike in cache terms. Pure and
synchronous; O(1) per write and per read.
"""

from __future__ import annotations

import math

from gateway.types import ReplicaId

# Rescale once the common factor would leave a comfortable float range.
_RESCALE_AFTER = 30.0


class ChurnMeter:
    """Per replica, `scaled[r] * factor()` is r's churn: the decay all replicas share is
    kept out of the per-replica values, so ranking n replicas costs n lookups and one
    exp, not n exps."""

    __slots__ = ("_base", "_clock", "_horizon", "scaled")

    def __init__(self, horizon_tokens: float) -> None:
        self._horizon = max(1.0, float(horizon_tokens))
        self._clock = 0.0  # tokens written by the whole cluster so far
        self._base = 0.0  # clock / horizon when `scaled` was last rescaled
        self.scaled: dict[ReplicaId, float] = {}

    @property
    def horizon_tokens(self) -> float:
        return self._horizon

    def factor(self) -> float:
        """What every `scaled` value is multiplied by to give tokens, as of now."""
        return math.exp(self._base - self._clock / self._horizon)

    def churn(self, replica: ReplicaId) -> float:
        """`replica`'s recent writes in tokens, as of now."""
        return self.scaled.get(replica, 0.0) * self.factor()

    def write(self, replica: ReplicaId, tokens: float) -> None:
        """`replica` prefills `tokens` it did not hold: what was written before ages by
        them, wherever it was written; they are this replica's newest."""
        if tokens <= 0:
            return
        self._clock += tokens
        if self._clock / self._horizon - self._base > _RESCALE_AFTER:
            self._rescale()
        self.scaled[replica] = self.scaled.get(replica, 0.0) + tokens / self.factor()

    def set_horizon(self, tokens: float) -> None:
        """The cluster's KV capacity changed (membership, scraped capacity)."""
        horizon = max(1.0, float(tokens))
        if horizon != self._horizon:
            self._rescale()
            self._horizon = horizon
            self._base = self._clock / horizon

    def forget(self, replica: ReplicaId) -> None:
        self.scaled.pop(replica, None)

    def _rescale(self) -> None:
        """Fold the shared factor into the values: O(replicas), once in many horizons."""
        f = self.factor()
        self.scaled = {r: v * f for r, v in self.scaled.items() if v * f > 1e-9}
        self._base = self._clock / self._horizon
