"""`least_load`: the replica with the smallest scraped queue/KV load plus local in-flight.

Ranks every candidate: known load ascending (divided by the replica's weight), then the
replicas whose load is unknown or stale (treated as saturated) by their in-flight count.
Ties go by a hash of the session key. Cost: the scrape-dependent part of each replica's
load, its staleness and a load order are computed once per view; per request, replicas are
visited in that order only until none left can beat the k-th best (k = RANK_DEPTH), since
local in-flight can only add load: O(k log k) typically, O(n log k) at worst.
"""

from __future__ import annotations

import heapq
from typing import ClassVar, NamedTuple

from pydantic import Field

from gateway.policy import RANK_DEPTH, PolicyConfig, PolicyContext
from gateway.types import Choice, ClusterView, ReplicaId, ReplicaState, RouteRequest
from plugins.load_model import LoadWeights, TieBreaker, add_ranked, load_terms


class LeastLoadConfig(PolicyConfig):
    weights: LoadWeights = Field(default_factory=LoadWeights)


class _Rows(NamedTuple):
    """Per-view data: everything but the in-flight counts, which change per request."""

    replicas: tuple[ReplicaState, ...]
    now: float
    stale_after: float
    ids: list[ReplicaId]
    reported: list[float | None]  # None: load unknown or stale
    values: list[float]  # weighted scraped load
    weights: list[float]
    base: list[float | None]  # values / weight
    hashes: list[int]
    unknown: bool
    order: list[int]  # known replicas by base load, ascending


class LeastLoad:
    name: ClassVar[str] = "least_load"
    Config: ClassVar[type[LeastLoadConfig]] = LeastLoadConfig

    def __init__(self, config: LeastLoadConfig, context: PolicyContext) -> None:
        self.config = config
        self._tie = TieBreaker()
        self._rows: _Rows | None = None

    def _per_view(self, view: ClusterView) -> _Rows:
        rows = self._rows
        if (
            rows is not None
            and rows.replicas is view.replicas
            and rows.now == view.now
            and rows.stale_after == view.stale_after
        ):
            return rows
        weights = self.config.weights
        now, stale = view.now, view.stale_after
        ids: list[ReplicaId] = []
        reported: list[float | None] = []
        values: list[float] = []
        weights_: list[float] = []
        base: list[float | None] = []
        hashes: list[int] = []
        for r in view.replicas:
            weight = r.weight if r.weight > 0 else 1.0
            ids.append(r.id)
            weights_.append(weight)
            hashes.append(self._tie.replica_hash(r.id))
            if r.load is None or not r.load.is_fresh(now, stale):
                reported.append(None)
                values.append(0.0)
                base.append(None)  # unknown or stale: saturated
            else:
                rep, value = load_terms(r.load, weights)
                reported.append(rep)
                values.append(value)
                base.append(value / weight)
        rows = self._rows = _Rows(
            view.replicas,
            now,
            stale,
            ids,
            reported,
            values,
            weights_,
            base,
            hashes,
            any(b is None for b in base),
            sorted((i for i, b in enumerate(base) if b is not None), key=base.__getitem__),  # type: ignore[arg-type]
        )
        return rows

    def choose(self, request: RouteRequest, view: ClusterView) -> Choice:
        rows = self._per_view(view)
        ids = rows.ids
        if not ids:
            return Choice((), "no_candidates", self.name)
        get = view.in_flight.get
        ww = self.config.weights.waiting
        sh = self._tie.session_hash(request.session_key)
        hashes, base, reported, values, weights_ = (
            rows.hashes,
            rows.base,
            rows.reported,
            rows.values,
            rows.weights,
        )
        k = RANK_DEPTH
        keyed: list[tuple[int, float, int, int]] = []

        def take(tier: int, pairs: list[tuple[float, int]], want: int) -> None:
            add_ranked(keyed, tier, pairs, want, sh, hashes)

        # Known replicas by their per-view load, a lower bound (in-flight only adds): stop
        # once that bound exceeds the k-th smallest actual load seen.
        pairs: list[tuple[float, int]] = []
        top: list[float] = []  # max-heap (negated) of the k smallest loads
        for i in rows.order:
            b = base[i]
            if len(top) == k and b > -top[0]:  # type: ignore[operator]
                break
            n = get(ids[i], 0)
            rep = reported[i]
            load = b if n <= rep else (values[i] + ww * (n - rep)) / weights_[i]  # type: ignore[operator]
            pairs.append((load, i))  # type: ignore[arg-type]
            if len(top) < k:
                heapq.heappush(top, -load)  # type: ignore[operator]
            elif load < -top[0]:  # type: ignore[operator]
                heapq.heapreplace(top, -load)  # type: ignore[operator]
        take(0, pairs, k)
        left = k - len(rows.order)
        if left > 0 and rows.unknown:
            take(
                1,
                [(get(ids[i], 0) / weights_[i], i) for i, x in enumerate(base) if x is None],
                left,
            )
        keyed.sort()
        del keyed[RANK_DEPTH:]  # the failover head is enough
        # Reasons are metric label values: a fixed, small set.
        reason = "unknown_load" if keyed[0][0] else "least_load"
        return Choice(tuple(ids[k[3]] for k in keyed), reason, self.name)
