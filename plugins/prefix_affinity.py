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

Cost: O(n) load arithmetic plus O(log L) index probes per replica holding the first block,
one O(n log n) sort for the failover order; the ring is walked only on a miss.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from pydantic import Field

from gateway.policy import PolicyConfig, PolicyContext
from gateway.ring import DEFAULT_VNODES, HashRing, RingNode
from gateway.types import Choice, ClusterView, ReplicaId, ReplicaState, RouteRequest
from plugins.load_model import MASK64, TIE_MULTIPLIER, LoadWeights, TieBreaker, load_terms
from plugins.prefix_index import PrefixIndex

DEFAULT_CAPACITY_TOKENS = 500_000


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
    ids: list[ReplicaId]
    terms: list[tuple[float, float, float] | None]  # (reported, weighted load, scraped_at)
    weights: list[float]
    hashes: list[int]


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
        in_flight = view.in_flight
        inflight = [in_flight.get(rid, 0) for rid in ids]
        now, stale, ww = view.now, view.stale_after, cfg.weights.waiting
        loads: list[float | None] = []
        for terms, n, weight in zip(snap.terms, inflight, snap.weights):
            if terms is None or now - terms[2] > stale:
                loads.append(None)  # unknown or stale: saturated
                continue
            reported, value, _ = terms
            if n > reported:
                value += ww * (n - reported)
            loads.append(value / weight)
        matched = self.index.matched_many(ids, hashes)

        known = [x for x in loads if x is not None]
        if not known:
            # Nothing scraped at all (scraping off, or start-up): judge by local in-flight.
            loads = [cfg.weights.waiting * n for n in inflight]
            known = [x for x in loads if x is not None]
        mean = sum(known) / len(known)
        limit = mean * cfg.overload_factor + cfg.overload_slack
        min_load = min(known)
        common = self._common_match(matched)
        need = cfg.min_match_fraction * min(prompt, span) if span else 1
        unit = self.unit_tokens

        tiers: list[int] = []
        scores: list[float] = []
        useful_any = shed = False
        followed: set[int] = set()  # candidates whose match counts
        for i, load in enumerate(loads):
            if load is None:
                tiers.append(_UNKNOWN)
                scores.append(-float(inflight[i]))
                continue
            if load > limit:
                tiers.append(_OVERLOADED)
                scores.append(-load)
                shed = shed or (matched[i] > common and matched[i] * bt >= need)
                continue
            useful = (matched[i] - common) * bt
            if useful <= 0 or matched[i] * bt < need:
                useful = 0
            else:
                useful_any = True
                if tail and matched[i] == len(hashes):
                    useful += tail
                followed.add(i)
            tiers.append(_ELIGIBLE)
            scores.append(cfg.match_weight * useful - cfg.load_weight * unit * (load - min_load))

        sh = self._tie.session_hash(request.session_key)
        # mix() inlined: this runs once per replica per request.
        keys = [
            (tier, -score, ((sh ^ rh) * TIE_MULTIPLIER) & MASK64)
            for tier, score, rh in zip(tiers, scores, snap.hashes)
        ]
        order = sorted(range(len(ids)), key=keys.__getitem__)
        ranked = [ids[i] for i in order]
        # Reasons are metric label values: a fixed, small set.
        if useful_any:
            # "load": a replica without a useful match won on load despite a match elsewhere.
            reason = "prefix_match" if order[0] in followed else "load"
        else:
            home = self._ring_home(request.session_key, ids, tiers)
            if home is not None:
                ranked.remove(home)
                ranked.insert(0, home)
                reason = "shed" if shed else "ring"
            else:
                reason = "least_loaded"
        return Choice(tuple(ranked), reason, self.name)

    def _snapshot(self, view: ClusterView, block_tokens: int) -> _Snapshot:
        """Per-view data, rebuilt only when the view's replica tuple changes (a new scrape
        or membership), not per request."""
        snap = self._snap
        if snap is not None and snap.replicas is view.replicas:
            return snap
        weights = self.config.weights
        ids: list[ReplicaId] = []
        terms: list[tuple[float, float, float] | None] = []
        for r in view.replicas:
            ids.append(r.id)
            load = r.load
            if load is None:
                terms.append(None)
                continue
            reported, value = load_terms(load, weights)
            terms.append((reported, value, load.scraped_at))
            if load.kv_capacity_tokens and r.id not in self._configured:
                # Scraped capacity sizes the index; configured capacity takes precedence.
                self.index.set_capacity(r.id, load.kv_capacity_tokens, block_tokens)
        snap = self._snap = _Snapshot(
            replicas=view.replicas,
            ids=ids,
            terms=terms,
            weights=[r.weight if r.weight > 0 else 1.0 for r in view.replicas],
            hashes=[self._tie.replica_hash(rid) for rid in ids],
        )
        return snap

    def _common_match(self, matched: list[int]) -> int:
        # At least two holders: with one, a conversation's own prefix would be "common".
        k = max(2, int(self.config.shared_quorum * len(matched)) + 1)
        holders = [m for m in matched if m]
        if len(holders) < k:
            return 0
        return heapq.nlargest(k, holders)[-1]

    def _ring_home(
        self, session_key: str, ids: list[ReplicaId], tiers: list[int]
    ) -> ReplicaId | None:
        eligible = {rid for rid, tier in zip(ids, tiers) if tier == _ELIGIBLE}
        if not eligible:
            return None
        ring = self._ring
        if not any(rid in ring.members for rid in eligible):
            # Never told the membership: build the ring from what the view shows.
            ring = self._ring = HashRing((RingNode(rid) for rid in ids), self.config.vnodes)
        return ring.first(session_key, eligible)
