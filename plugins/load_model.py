"""Load arithmetic shared by the load-aware policies: one number per replica.

Units are "queued-request equivalents". Scraped engine gauges are authoritative but up to
one scrape interval old; the gateway's own in-flight count is exact but local. Requests
this gateway has in flight beyond what the engine reported are counted as waiting, which
corrects the burst ("incast") that a stale scrape would otherwise invite.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from gateway.hashing import hash_key
from gateway.types import EngineLoad, ReplicaId

MASK64 = (1 << 64) - 1
TIE_MULTIPLIER = 0x9E3779B97F4A7C15
KV_USAGE_CAP = 0.99


class LoadWeights(BaseModel):
    """How much each load signal weighs, in queued-request equivalents."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    waiting: float = Field(default=1.0, ge=0, description="per request waiting in the engine queue")
    running: float = Field(default=0.5, ge=0, description="per request in the running batch")
    kv_usage: float = Field(
        default=1.0,
        ge=0,
        description="scale of the kv/(1-kv) pressure term (0.5 usage adds 1x this)",
    )


def load_terms(load: EngineLoad, weights: LoadWeights) -> tuple[float, float]:
    """(requests the engine reported, their weighted load incl. KV pressure): the part of a
    replica's load that depends on the scrape only, so policies can cache it per view (the
    requests in flight past what the engine reported are added by each policy)."""
    value = weights.waiting * load.waiting + weights.running * load.running
    if load.kv_usage is not None and weights.kv_usage:
        kv = min(max(load.kv_usage, 0.0), KV_USAGE_CAP)
        value += weights.kv_usage * kv / (1.0 - kv)
    return load.waiting + load.running, value


class TieBreaker:
    """Deterministic per-session order of replicas: no list-order hot spot, same on every
    gateway instance. Replica hashes are cached; the per-call cost is one multiply."""

    def __init__(self) -> None:
        self._replica_hash: dict[ReplicaId, int] = {}

    def session_hash(self, session_key: str) -> int:
        return hash_key(session_key)

    def replica_hash(self, replica: ReplicaId) -> int:
        rh = self._replica_hash.get(replica)
        if rh is None:
            rh = self._replica_hash[replica] = hash_key(replica)
        return rh

    def rank(self, session_hash: int, replica: ReplicaId) -> int:
        return mix(session_hash, self.replica_hash(replica))


def mix(session_hash: int, replica_hash: int) -> int:
    """Tie-break key; the multiply spreads every input bit into the high bits that decide
    the order (hot paths inline this expression)."""
    return ((session_hash ^ replica_hash) * TIE_MULTIPLIER) & MASK64


RankKey = tuple[int, float, int, int]


def add_ranked(
    out: list[RankKey],
    tier: int,
    pairs: list[tuple[float, int]],
    want: int,
    session_hash: int,
    replica_hashes: list[int],
) -> None:
    """Append `(tier, value, tie, index)` sort keys for the `want` smallest values of one tier.

    Replicas beyond the want-th smallest value already have `want` replicas strictly ahead
    of them, so they cannot enter a top-`want` ranking; skipping them keeps a decision
    O(k log k) per tier instead of O(n log n). Ties at the cut are all kept.
    """
    if len(pairs) > want:
        cut = sorted(p[0] for p in pairs)[want - 1]
        pairs = [p for p in pairs if p[0] <= cut]
    for v, i in pairs:
        out.append((tier, v, ((session_hash ^ replica_hashes[i]) * TIE_MULTIPLIER) & MASK64, i))
