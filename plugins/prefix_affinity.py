"""`prefix_affinity`: send a request where its prompt prefix is already cached, unless that
replica is overloaded; otherwise keep the session on its consistent-hash ring replica.

Per candidate r (the view's replicas, already filtered by the router):

* ``matched_r``: leading prompt blocks recently sent to r (`PrefixIndex`, approximate).
* ``useful_r = (matched_r - common) * block_tokens`` where ``common`` is the match that
  more than ``shared_quorum`` of the candidates reach: blocks most replicas hold already
  (typically a shared system prompt) save nothing by choosing between them, and the rest
  pick them up after one miss, so such a prefix cannot pull all traffic onto the few
  replicas that saw it first. A match covering less than ``min_match_fraction`` of the
  prompt counts as none.
* ``load_r``: scraped queue/running/KV load plus unreported local in-flight (see
  `plugins.load_model`), divided by the replica's weight; unknown or stale load is
  saturated.
* Replicas above ``overload_factor * mean(load) + overload_slack`` are overloaded: they
  are ranked last even when they hold the best match, which sheds their load.
* ``score_r = match_weight * useful_r - load_weight * unit * (load_r - min load)``, where
  ``unit`` is the running mean of prefill tokens a request needs (after its cache hit).

The highest score wins; if no eligible replica has a useful match, the request goes to
the first eligible replica clockwise from its session key on the ring, so new
conversations spread evenly and later turns find their prefix there. Ties are broken by a
hash of the session key. `placed` records the prompt blocks on the replica that served.

Cost: one flat O(n) pass (the mean load needs every replica's in-flight count); matches
come from the index's reverse map in O(g log L) set operations (g = distinct match
lengths); the failover head (k = RANK_DEPTH) comes from a walk in per-view load order that
stops once no replica left can beat the k-th best; the ring is walked only on a miss.
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import ClassVar

from pydantic import Field

from gateway.policy import RANK_DEPTH, PolicyConfig, PolicyContext
from gateway.ring import DEFAULT_VNODES, HashRing, RingNode
from gateway.types import Choice, ClusterView, ReplicaId, ReplicaState, RouteRequest
from plugins.load_model import (
    LoadWeights,
    TieBreaker,
    add_ranked,
    load_terms,
)
from plugins.prefix_index import DEFAULT_CAPACITY_TOKENS, PrefixIndex


class PrefixAffinityConfig(PolicyConfig):
    weights: LoadWeights = Field(default_factory=LoadWeights)
    match_weight: float = Field(default=1.0, ge=0, description="value of one prefill token saved")
    load_weight: float = Field(
        default=0.3,
        ge=0,
        description="cost of one unit of load as a share of the mean prefill tokens a request "
        "needs (queued prefill is chunked and batched, so it delays a newcomer by less)",
    )
    min_match_fraction: float = Field(
        default=0.2,
        ge=0,
        le=1,
        description="a match covering less of the prompt than this counts as none",
    )
    shared_quorum: float = Field(
        default=0.25,
        ge=0,
        lt=1,
        description="a prefix held by more than this share of candidates is not a reason",
    )
    overload_factor: float = Field(default=1.25, ge=1.0, description="bounded load vs the mean")
    overload_slack: float = Field(
        default=2.0, ge=0, description="extra load allowed above the bound"
    )
    min_request_tokens: int = Field(default=256, ge=1, description="floor of the per-request unit")
    initial_request_tokens: int = Field(default=2048, ge=1, description="unit before any placement")
    ewma_alpha: float = Field(default=0.05, gt=0, le=1, description="smoothing of the unit")
    default_capacity_tokens: int = Field(
        default=DEFAULT_CAPACITY_TOKENS,
        ge=1,
        description="KV capacity when neither configured nor scraped",
    )
    index_capacity_factor: float = Field(default=1.0, gt=0, description="index size vs KV capacity")
    vnodes: int = Field(
        default=DEFAULT_VNODES, ge=1, description="virtual nodes of the fallback ring"
    )


_ELIGIBLE, _OVERLOADED, _UNKNOWN = 0, 1, 2


@dataclass(frozen=True, slots=True)
class _Snapshot:
    replicas: tuple[ReplicaState, ...]
    now: float
    stale_after: float
    ids: list[ReplicaId]
    position: dict[ReplicaId, int]
    reported: list[float | None]  # None: load unknown or stale
    values: list[float]  # weighted scraped load
    base: list[float | None]  # values / weight, the load with no unreported in-flight
    unknown: bool
    order: list[int]  # known replicas by base load, ascending
    weights: list[float]
    hashes: list[int]


class _Eligible:
    """Membership test "load known and not overloaded", so the ring walk asks only about
    the replicas it passes instead of a set of all eligible being built per request."""

    __slots__ = ("_limit", "_loads", "_position")

    def __init__(
        self, position: dict[ReplicaId, int], loads: list[float | None], limit: float
    ) -> None:
        self._position, self._loads, self._limit = position, loads, limit

    def __contains__(self, rid: object) -> bool:
        i = self._position.get(rid)  # type: ignore[call-overload]
        if i is None:
            return False
        load = self._loads[i]
        return load is not None and load <= self._limit


class PrefixAffinity:
    name: ClassVar[str] = "prefix_affinity"
    Config: ClassVar[type[PrefixAffinityConfig]] = PrefixAffinityConfig

    def __init__(self, config: PrefixAffinityConfig, context: PolicyContext) -> None:
        self.config = config
        self.index = PrefixIndex(config.default_capacity_tokens, config.index_capacity_factor)
        self._tie = TieBreaker()
        self._unit = float(config.initial_request_tokens)
        self._configured: set[ReplicaId] = set()
        self._block_tokens = 16
        self._ring = HashRing((), config.vnodes)
        self._snap: _Snapshot | None = None
        self.membership_changed(context.replicas)

    # -- abilities -------------------------------------------------------------------

    def membership_changed(self, replicas: Sequence[ReplicaState]) -> None:
        live = {r.id for r in replicas}
        for gone in set(self._ring.members) - live:
            self.index.forget(gone)
        self._ring = HashRing((RingNode(r.id, r.weight) for r in replicas), self.config.vnodes)
        self._configured = set()
        for r in replicas:
            if r.kv_capacity_tokens:
                self._configured.add(r.id)
                self.index.set_capacity(r.id, r.kv_capacity_tokens, self._block_tokens)

    def placed(self, request: RouteRequest, replica: ReplicaId) -> None:
        hashes = request.prefix_hashes
        if not hashes:
            return
        bt = self._block_tokens = request.block_tokens or 1
        prompt = max(request.prompt_tokens, len(hashes) * bt)
        new_tokens = max(0, prompt - self.cached_tokens(request, replica))
        self._unit += self.config.ewma_alpha * (new_tokens - self._unit)
        self.index.record(replica, hashes, bt)

    def cached_tokens(self, request: RouteRequest, replica: ReplicaId) -> int:
        """Leading prompt tokens `replica` likely holds (the PD decision asks this)."""
        hashes = request.prefix_hashes
        matched = self.index.matched(replica, hashes) if hashes else 0
        tokens = matched * request.block_tokens
        if matched and matched == len(hashes):
            # Only a capped number of blocks is hashed; a full match probably goes on.
            return max(tokens, request.prompt_tokens)
        return min(tokens, request.prompt_tokens) if request.prompt_tokens else tokens

    @property
    def unit_tokens(self) -> float:
        return max(float(self.config.min_request_tokens), self._unit)

    # -- decision --------------------------------------------------------------------

    def choose(self, request: RouteRequest, view: ClusterView) -> Choice:
        replicas = view.replicas
        if not replicas:
            return Choice((), "no_candidates", self.name)
        cfg = self.config
        hashes = request.prefix_hashes
        bt = request.block_tokens or 1
        span = len(hashes) * bt
        prompt = max(request.prompt_tokens, span)
        # Only the first blocks are hashed (session.max_prefix_blocks): judge the match on
        # the hashed span, and credit a match over all of it with the unhashed rest too.
        tail = prompt - span
        snap = self._snapshot(view, bt)
        ids = snap.ids
        get = view.in_flight.get
        inflight = [get(rid, 0) for rid in ids]
        ww = cfg.weights.waiting
        # The only per-request load term is in-flight beyond what the scrape reported; the
        # rest (and staleness, fixed per view) is precomputed. One flat pass, no branches
        # per replica beyond the comparison.
        loads: list[float | None] = [
            base if rep is None or n <= rep else (value + ww * (n - rep)) / weight
            for base, rep, value, weight, n in zip(
                snap.base, snap.reported, snap.values, snap.weights, inflight
            )
        ]
        if snap.unknown:
            known = [x for x in loads if x is not None]
            if not known:
                # Nothing scraped at all (scraping off, or start-up): judge by local in-flight.
                loads = [ww * n for n in inflight]
                known = loads  # type: ignore[assignment]
        else:
            known = loads  # type: ignore[assignment]
        mean = sum(known) / len(known)
        limit = mean * cfg.overload_factor + cfg.overload_slack
        min_load = min(known)
        matched = self.index.matched_sparse(snap.position, hashes)
        common = self._common_match(list(matched.values()), len(ids))
        need = cfg.min_match_fraction * min(prompt, span) if span else 1
        c = cfg.load_weight * self.unit_tokens
        mw = cfg.match_weight

        # Ranking key (tier, -score, tie). Unknown: (2, inflight); overloaded: (1, load);
        # eligible without a useful match: (0, -(0 - c * (load - min))) -- only replicas
        # holding a match can score otherwise, and they are few.
        useful_any = shed = False
        followed: dict[int, float] = {}  # candidates whose match counts -> -score
        for i, m in matched.items():
            load = loads[i]
            if load is None:
                continue
            if load > limit:
                shed = shed or (m > common and m * bt >= need)
                continue
            useful = (m - common) * bt
            if useful > 0 and m * bt >= need:
                useful_any = True
                if tail and m == len(hashes):
                    useful += tail
                followed[i] = -(mw * useful - c * (load - min_load))

        zero = mw * 0
        picked = self._walk(snap, loads, followed, limit, zero, c, min_load)
        if picked is None:  # fewer than RANK_DEPTH eligible, or no scraped load at all
            elig = [
                i for i, x in enumerate(loads) if x is not None and x <= limit and i not in followed
            ]
            pairs = [(-(zero - c * (loads[i] - min_load)), i) for i in elig]  # type: ignore[operator]
            pairs.extend((v, i) for i, v in followed.items())
            picked = pairs
        picked_idx = self._head(request.session_key, snap, loads, inflight, picked, limit)
        ranked = [ids[i] for i in picked_idx]
        # Reasons are metric label values: a fixed, small set.
        if useful_any:
            # "load": a replica without a useful match won on load despite a match elsewhere.
            reason = "prefix_match" if picked_idx[0] in followed else "load"
        else:
            home = self._ring_home(request.session_key, ids, _Eligible(snap.position, loads, limit))
            if home is not None:
                if home in ranked:
                    ranked.remove(home)
                ranked.insert(0, home)
                reason = "shed" if shed else "ring"
            else:
                reason = "least_loaded"
        return Choice(tuple(ranked), reason, self.name)

    @staticmethod
    def _walk(
        snap: _Snapshot,
        loads: list[float | None],
        followed: dict[int, float],
        limit: float,
        zero: float,
        c: float,
        min_load: float,
    ) -> list[tuple[float, int]] | None:
        """(-score, index) of the followed replicas and of enough eligible ones to hold the
        RANK_DEPTH best: replicas are visited by their per-view load without in-flight, a
        lower bound of their load, and -score only grows with load, so the walk stops once
        that bound cannot reach the k-th best -score seen. None: not enough eligible."""
        if not snap.order:
            return None
        k = RANK_DEPTH
        pairs = [(v, i) for i, v in followed.items()]
        top = [-v for v, _ in pairs]  # max-heap (negated) of the k smallest -score
        heapq.heapify(top)
        while len(top) > k:
            heapq.heappop(top)
        base = snap.base
        for i in snap.order:
            if len(top) == k and -(zero - c * (base[i] - min_load)) > -top[0]:  # type: ignore[operator]
                return pairs
            load = loads[i]
            if load > limit or i in followed:  # type: ignore[operator]
                continue
            v = -(zero - c * (load - min_load))  # type: ignore[operator]
            pairs.append((v, i))
            if len(top) < k:
                heapq.heappush(top, -v)
            elif v < -top[0]:
                heapq.heapreplace(top, -v)
        return pairs if len(top) == k else None

    def _head(
        self,
        session_key: str,
        snap: _Snapshot,
        loads: list[float | None],
        inflight: list[int],
        eligible: list[tuple[float, int]],
        limit: float,
    ) -> list[int]:
        """Indices of the first RANK_DEPTH replicas by (tier, -score, tie). Exact keys are
        built only for replicas whose -score is within the k-th smallest of their tier: any
        replica beyond it has at least k replicas strictly ahead."""
        sh = self._tie.session_hash(session_key)
        hashes = snap.hashes
        k = RANK_DEPTH
        keys: list[tuple[int, float, int, int]] = []

        def take(tier: int, pairs: list[tuple[float, int]], want: int) -> None:
            add_ranked(keys, tier, pairs, want, sh, hashes)

        take(_ELIGIBLE, eligible, k)
        left = k - len(eligible)
        if left > 0:
            over = [(x, i) for i, x in enumerate(loads) if x is not None and x > limit]
            take(_OVERLOADED, over, left)
            left -= len(over)
            if left > 0 and snap.unknown:
                # -score of an unknown replica is minus its in-flight count.
                unknown = [(float(inflight[i]), i) for i, x in enumerate(loads) if x is None]
                take(_UNKNOWN, unknown, left)
        keys.sort()
        return [key[3] for key in keys[:k]]

    def _snapshot(self, view: ClusterView, block_tokens: int) -> _Snapshot:
        """Per-view data, rebuilt only when the view changes (a new scrape or membership),
        not per request."""
        snap = self._snap
        if (
            snap is not None
            and snap.replicas is view.replicas
            and snap.now == view.now
            and snap.stale_after == view.stale_after
        ):
            return snap
        weights = self.config.weights
        ids: list[ReplicaId] = []
        reported: list[float | None] = []
        values: list[float] = []
        base: list[float | None] = []
        now, stale = view.now, view.stale_after
        ws = [r.weight if r.weight > 0 else 1.0 for r in view.replicas]
        for r, weight in zip(view.replicas, ws):
            ids.append(r.id)
            load = r.load
            if load is None or not load.is_fresh(now, stale):
                reported.append(None)
                values.append(0.0)
                base.append(None)  # unknown or stale: saturated
            else:
                rep, value = load_terms(load, weights)
                reported.append(rep)
                values.append(value)
                base.append(value / weight)
            if load is not None and load.kv_capacity_tokens and r.id not in self._configured:
                # Scraped capacity sizes the index; configured capacity takes precedence.
                self.index.set_capacity(r.id, load.kv_capacity_tokens, block_tokens)
        snap = self._snap = _Snapshot(
            replicas=view.replicas,
            now=now,
            stale_after=stale,
            ids=ids,
            position={rid: i for i, rid in enumerate(ids)},
            reported=reported,
            values=values,
            base=base,
            unknown=any(b is None for b in base),
            order=sorted((i for i, b in enumerate(base) if b is not None), key=base.__getitem__),  # type: ignore[arg-type]
            weights=ws,
            hashes=[self._tie.replica_hash(rid) for rid in ids],
        )
        return snap

    def _common_match(self, holders: list[int], candidates: int) -> int:
        # At least two holders: with one, a conversation's own prefix would be "common".
        k = max(2, int(self.config.shared_quorum * candidates) + 1)
        if len(holders) < k:
            return 0
        return heapq.nlargest(k, holders)[-1]

    def _ring_home(
        self, session_key: str, ids: list[ReplicaId], eligible: Container[ReplicaId]
    ) -> ReplicaId | None:
        ring = self._ring
        members = ring.members
        # Both scans stop at the first hit, normally within a few replicas.
        if not any(rid in eligible for rid in ids):
            return None
        if not any(rid in members and rid in eligible for rid in ids):
            # Never told the membership: build the ring from what the view shows.
            ring = self._ring = HashRing((RingNode(rid) for rid in ids), self.config.vnodes)
        return ring.first(session_key, eligible)
