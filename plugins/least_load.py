"""`least_load`: the replica with the smallest scraped queue/KV load plus local in-flight.

Ranks every candidate: known load ascending (divided by the replica's weight), then the
replicas whose load is unknown or stale (treated as saturated) by their in-flight count.
Ties go by a hash of the session key. Cost: O(n log n) in the number of candidates; the
scrape-dependent part of each replica's load is computed once per view, not per request.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from gateway.policy import PolicyConfig, PolicyContext
from gateway.types import Choice, ClusterView, ReplicaId, ReplicaState, RouteRequest
from plugins.load_model import LoadWeights, TieBreaker, load_terms, mix


class LeastLoadConfig(PolicyConfig):
    weights: LoadWeights = Field(default_factory=LoadWeights)


_Terms = tuple[float, float, float] | None  # (reported requests, weighted load, scraped_at)


class LeastLoad:
    name: ClassVar[str] = "least_load"
    Config: ClassVar[type[LeastLoadConfig]] = LeastLoadConfig

    def __init__(self, config: LeastLoadConfig, context: PolicyContext) -> None:
        self.config = config
        self._tie = TieBreaker()
        self._seen: tuple[ReplicaState, ...] | None = None
        self._rows: list[tuple[ReplicaId, _Terms, float, int]] = []

    def _per_view(self, view: ClusterView) -> list[tuple[ReplicaId, _Terms, float, int]]:
        if view.replicas is not self._seen:
            weights = self.config.weights
            rows = []
            for r in view.replicas:
                terms: _Terms = None
                if r.load is not None:
                    reported, value = load_terms(r.load, weights)
                    terms = (reported, value, r.load.scraped_at)
                weight = r.weight if r.weight > 0 else 1.0
                rows.append((r.id, terms, weight, self._tie.replica_hash(r.id)))
            self._seen, self._rows = view.replicas, rows
        return self._rows

    def choose(self, request: RouteRequest, view: ClusterView) -> Choice:
        rows = self._per_view(view)
        if not rows:
            return Choice((), "no_candidates", self.name)
        sh = self._tie.session_hash(request.session_key)
        in_flight = view.in_flight
        now, stale, ww = view.now, view.stale_after, self.config.weights.waiting
        keyed: list[tuple[int, float, int, ReplicaId]] = []
        for rid, terms, weight, rh in rows:
            n = in_flight.get(rid, 0)
            if terms is None or now - terms[2] > stale:
                keyed.append((1, n / weight, mix(sh, rh), rid))
                continue
            reported, value, _ = terms
            if n > reported:
                value += ww * (n - reported)  # sent since the scrape, not yet reported
            keyed.append((0, value / weight, mix(sh, rh), rid))
        keyed.sort()
        # Reasons are metric label values: a fixed, small set.
        reason = "unknown_load" if keyed[0][0] else "least_load"
        return Choice(tuple(k[3] for k in keyed), reason, self.name)
