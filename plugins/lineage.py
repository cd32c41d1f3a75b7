"""`lineage` (the default): each conversation stays where its KV prefix is; new ones go
where they cost least, counting the sessions each replica already carries.

The session key is the client's (header, `prompt_cache_key`) or, without one, the
conversation's lineage inferred from the prompt (gateway.lineage). Per request:

* **Sticky.** A session placed before (the store's placement, else this policy's own table
  of live sessions) stays on its replica while that replica is a candidate (healthy,
  serves the model) and the prefill queued there, in seconds, exceeds the cluster's mean
  by at most ``stay_queue_s``: the uncached prompt tokens this gateway sent there with no
  first token yet, over the replica's prefill speed measured from its answers
  (``view.prefill``), plus the requests the engine reports waiting beyond this gateway's
  (other gateways' or other clients' work; a saturated engine sheds its sessions), each
  the mean request's uncached prefill. Requests decoding there do not count. Past that
  bound it still stays while the excess is at most what moving costs: its cached prefix
  recomputed elsewhere, in seconds at the cluster's mean speed (a 100K-token history is
  7 s on a replica of 14K tokens/s, 14 s at half that: under heavy load a fixed bound
  moved long conversations to replicas as busy once their recompute was queued). Until a
  speed is measured only health moves a session. The move is remembered: it then stays
  where it moved.
* **Placed.** A new session, or one that must move, goes to the replica of least cost

      cost_r = (load_r + cache_weight * uncached_r + unit * live_r) / weight_r

  in prefill tokens: ``load_r`` is the prefill this gateway sent to r that has not
  produced a first byte yet, plus 256 tokens per request in flight and
  ``queue_weight * unit`` per request the engine reports waiting; ``uncached_r`` is the
  prompt minus what r's prefix index holds of it; ``live_r`` counts r's live sessions
  (each will send more turns); ``unit`` is the running mean of uncached prefill per
  request. For a new session with no hot prefix a recomputed token weighs what it costs
  on r (plugins/kv_pressure.py): its own prefill and the cluster's lost work over n
  replicas, ``1 + 1/n``, while r's KV keeps what returning sessions need, rising to
  ``cache_weight`` as the prefill r took in over a few gaps between a session's requests
  approaches the KV its cache has, its capacity less what running requests hold (then a
  copy evicts what others come back for); without that a replica holding popular
  documents took every new session opening with them, 2x the mean prefill (issue 45, the
  rag shape). Such a session does not weigh live sessions
  either: the load there now decides and they only break ties (in `kvgate simulate`,
  counting them in full gave a higher mean TTFT on 8 of 10 trace windows without shared
  preambles; the small weight that stood here, ``cold_session_weight``, at 0, halved or
  doubled moved no issue-45 shape beyond its seeds' spread). A session moved by the bound
  ranks its old replica last, or that replica's cache would win it straight back.
* **Hot preambles spread, deep prefixes pull** (plugins/spread.py). A high ``cache_weight``
  makes a fork of one conversation follow its cache, but would pile every new session of
  an agent kind onto the replica that first cached the kind's preamble. Once ``hot_after``
  new sessions have branched at a prefix, a new session from it goes only to the replicas
  within ``2 x session_band`` of the lowest load score (live sessions and their context
  tokens), by cost among those; unless the prefix the best replica holds beyond what most
  replicas hold is longer than what a new session will send later (one conversation's
  history, not a preamble): then the request follows it to its replica, unless that
  replica's load is over the sticky bound or exceeds the least loaded replica's by more
  than that prefix (tokens queued against tokens recomputed; each live session there
  counts as the prefill its further turns will bring, or one agent kind's sessions all
  follow its preamble to one replica).

With KV cache events (gateway.kvevents), ``view.cache_evidence`` says what each replica
really holds of the prompt: ``uncached_r`` then comes from it for every replica it knows
(the prefix index answers for the others), and a sticky session whose replica evicted it
(holds less than ``evicted_fraction`` of what the best replica holds, or nothing) is
placed again as if new (reason ``evicted``): staying would recompute it there anyway.
Events that hold none of the prompt anywhere say nothing of where it should go (it is in
flight through another gateway, or evicted everywhere): the prefix index answers then.

Unknown or stale engine load is not held against a replica (the gateway's own counts
still are), so this policy ranks saturated replicas itself (`handles_saturation`).

Cost: the sticky path is O(1) (per-replica and cluster totals of queued prefill kept at
dispatch and first byte, the cluster's mean speed read once per view) plus a ring walk of
RANK_DEPTH for the failover order; a placement is O(n) in the candidates.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from pydantic import Field, model_validator

from gateway.policy import RANK_DEPTH, PolicyConfig, PolicyContext
from gateway.ring import DEFAULT_VNODES, HashRing, RingNode
from gateway.types import (
    CacheEvidence,
    Choice,
    ClusterView,
    PrefillSignals,
    ReplicaId,
    ReplicaState,
    RouteRequest,
)
from plugins.kv_pressure import KvPressure, token_weight
from plugins.live_sessions import LiveSessions
from plugins.load_model import TieBreaker, mix
from plugins.prefix_index import DEFAULT_CAPACITY_TOKENS, PrefixIndex
from plugins.spread import BranchPoints, SessionTraffic, band, beyond_common

# The running means of uncached prefill (per request, per continued turn): their weight
# per sample, the value before any, and the floor of the per-request one. Constants, not
# settings: in `kvgate simulate` (docs/routing.md, issue 45, third) halving or doubling
# each moved no shape beyond its seeds' spread; no smoothing at all (1) cost 0.7-2.4
# points of hit.
_UNIT_ALPHA = 0.05
_INITIAL_REQUEST_TOKENS = 2048.0
_MIN_REQUEST_TOKENS = 256.0
# A request in flight weighs this many prompt tokens besides its prefill (its decode
# steps); a live session, one mean per-request uncached prefill (the turn it will send).
# Constants, not settings: in `kvgate simulate` halving or doubling either moved no shape
# beyond its seeds' spread, at full and at half prefill speed and on the Mooncake windows
# (docs/routing.md, issue 45, seventh); at 0 each cost something somewhere (samples' mean
# without the first, agent's without the second), so they stay, at their old defaults.
_INFLIGHT_TOKENS = 256.0
_SESSION_WEIGHT = 1.0

# Fields deleted in issue 45 and what took their place. The config rejects unknown keys
# anyway; naming these says what to do instead of only that the key is unknown.
REMOVED_FIELDS = {
    "load_factor": "the sticky bound is in seconds now: stay_queue_s over the mean",
    "slack_requests": "the sticky bound is in seconds now: stay_queue_s",
    "band_owed_s": "the owed-prefill band was removed (it lost hit on every shape but forks)",
    "churn_weight": "the cache-churn weight was removed (off by default, never kept on)",
    "cold_session_weight": "a new session with no hot prefix goes by the load now; live "
    "sessions only break ties there",
    "initial_request_tokens": "a constant now (2048)",
    "min_request_tokens": "a constant now (256)",
    "ewma_alpha": "a constant now (0.05)",
    "session_weight": "a constant now (1 mean prefill per live session)",
    "inflight_tokens": "a constant now (256 tokens per request in flight)",
}


class LineageConfig(PolicyConfig):
    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            gone = [f"{k} ({REMOVED_FIELDS[k]})" for k in data if k in REMOVED_FIELDS]
            if gone:
                raise ValueError("lineage: removed setting(s): " + "; ".join(gone))
        return data

    stay_queue_s: float = Field(
        default=8.0,
        ge=0,
        description="seconds: a sticky replica keeps its sessions while the prefill queued "
        "there (uncached prompt tokens this gateway sent with no first token yet, plus the "
        "engine's waiting requests beyond those at a mean request each, over its measured "
        "prefill speed) exceeds the cluster's mean by at most this, or by at most the time "
        "its cached prefix would take to recompute elsewhere at the cluster's mean speed",
    )
    cache_weight: float = Field(
        default=16.0,
        ge=0,
        description="weight of an uncached prompt token against one queued when "
        "placing, where the prefix is hot or deep, for a moved session, and on a replica whose "
        "KV is under full pressure (a new session with no hot prefix weighs 1 + 1/n there "
        "while the replica's KV keeps what its sessions come back for, rising to this)",
    )
    session_band: float | None = Field(
        default=0.2,
        ge=0,
        description="a new session that opens with a hot prefix goes only "
        "to replicas whose load score (live sessions over their mean plus those sessions' "
        "latest prompt tokens over theirs) is within 2 x this of the lowest",
    )
    hot_after: int = Field(
        default=3,
        ge=1,
        description="new sessions branching where the prompt's cached prefix "
        "ends that make that prefix hot (a shared preamble, not one conversation's fork)",
    )
    queue_weight: float = Field(
        default=1.0,
        ge=0,
        description="load of one request the engine reports waiting, in mean per-request prefills",
    )
    session_idle_s: float = Field(
        default=900.0, gt=0, description="a session not seen this long no longer counts as live"
    )
    max_sessions: int = Field(default=1 << 18, ge=1, description="live sessions remembered")
    default_capacity_tokens: int = Field(
        default=DEFAULT_CAPACITY_TOKENS, ge=1, description="KV capacity when not scraped"
    )
    index_capacity_factor: float = Field(
        default=4.0,
        gt=0,
        description="prefix index size vs KV: it remembers where prompts went "
        "longer than engines keep them, so a conversation evicted there goes back there "
        "(a copy elsewhere would take a second replica's cache)",
    )
    vnodes: int = Field(default=DEFAULT_VNODES, ge=1, description="failover ring vnodes")
    evicted_fraction: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="with KV cache events: a sticky replica holding "
        "less than this share of the best replica's cached prefix (or none of it) counts as "
        "having evicted the session, which is then placed again",
    )


class Lineage:
    name: ClassVar[str] = "lineage"
    Config: ClassVar[type[LineageConfig]] = LineageConfig
    # The load bound below replaces the router's not_saturated demotion.
    handles_saturation: ClassVar[bool] = True

    def __init__(self, config: LineageConfig, context: PolicyContext) -> None:
        self.config = config
        self.index = PrefixIndex(config.default_capacity_tokens, config.index_capacity_factor)
        self.sessions = LiveSessions(config.session_idle_s, config.max_sessions)
        self._tie = TieBreaker()
        self._unit = _INITIAL_REQUEST_TOKENS
        self._pending: dict[ReplicaId, float] = {}
        self._pending_total = 0.0
        self._open: dict[str, tuple[ReplicaId, float]] = {}
        self._ring = HashRing((), config.vnodes)
        self._now = 0.0
        self._view_key: tuple[ReplicaState, ...] | None = None
        self._view_prefill: PrefillSignals | None = None
        self._queued: dict[ReplicaId, float] = {}
        self._pinned: dict[ReplicaId, float] = {}  # KV share running requests hold, per view
        self._mean_speed: float | None = None
        self._beyond_tokens = 0.0  # engines' waiting beyond this gateway's, in tokens
        self._speeds: dict[ReplicaId, float] = {}  # measured prefill tokens/s, per view
        self._capacity_seen: dict[ReplicaId, int] = {}
        self._block_tokens = 512  # of the requests' prefix hashes, learnt from them
        self._branches = BranchPoints(config.max_sessions)
        self._evidence: CacheEvidence | None = None
        self._traffic = SessionTraffic(_UNIT_ALPHA)
        self._pressure = KvPressure()
        self.membership_changed(context.replicas)

    # -- abilities ---------------------------------------------------------------------

    def membership_changed(self, replicas: Sequence[ReplicaState]) -> None:
        live = {r.id for r in replicas}
        for gone in set(self._ring.members) - live:
            self.index.forget(gone)
            self.sessions.forget(gone)
            self._capacity_seen.pop(gone, None)
            self._pressure.forget(gone)
        self._ring = HashRing((RingNode(r.id, r.weight) for r in replicas), self.config.vnodes)
        for r in replicas:
            if r.kv_capacity_tokens:
                self.index.set_capacity(r.id, r.kv_capacity_tokens, self._block_tokens)
                self._capacity_seen.setdefault(r.id, r.kv_capacity_tokens)

    def cached_tokens(self, request: RouteRequest, replica: ReplicaId) -> int:
        """Leading prompt tokens `replica` likely holds (admission and PD ask this)."""
        hashes = request.prefix_hashes
        if not hashes:
            return 0
        if self._evidence is not None:
            precise = self._precise(self._evidence, request)
            if precise is not None and replica in precise:
                return min(precise[replica], request.prompt_tokens or precise[replica])
        tokens = self.index.matched(replica, hashes) * request.block_tokens
        return min(tokens, request.prompt_tokens) if request.prompt_tokens else tokens

    def dispatched(self, request: RouteRequest, replica: ReplicaId) -> None:
        """The request was sent to `replica`: its uncached prefill is now that replica's."""
        self.prefilled(request)
        tokens = float(max(0, request.prompt_tokens - self.cached_tokens(request, replica)))
        self._open[request.request_id] = (replica, tokens)
        self._pending[replica] = self._pending.get(replica, 0.0) + tokens
        self._pending_total += tokens
        self._unit += _UNIT_ALPHA * (tokens - self._unit)
        self._pressure.sent(replica, tokens, self._now)

    def prefilled(self, request: RouteRequest) -> None:
        """The prefill is over (first byte, failure or end); idempotent."""
        entry = self._open.pop(request.request_id, None)
        if entry is None:
            return
        replica, tokens = entry
        left = self._pending.get(replica, 0.0) - tokens
        self._pending[replica] = left if left > 1e-6 else 0.0
        self._pending_total = max(0.0, self._pending_total - tokens)

    def placed(self, request: RouteRequest, replica: ReplicaId) -> None:
        hashes = request.prefix_hashes
        seen = self.sessions.seen(request.session_key, self._now)
        home = None
        if seen is not None:
            home, last = seen
            self._pressure.gap(self._now - last)
        self._count_request(request, replica, home)
        if hashes:
            self._block_tokens = request.block_tokens or 1
            if self.config.session_band is not None and home is None:
                self._branches.opened(hashes, self.index.matched(replica, hashes))
            self.index.record(replica, hashes, self._block_tokens)
        self.sessions.place(request.session_key, replica, self._now, request.prompt_tokens)

    def _count_request(
        self, request: RouteRequest, replica: ReplicaId, home: ReplicaId | None
    ) -> None:
        """Requests per session and a continued turn's uncached prefill (spread.py)."""
        if home is None:
            self._traffic.new_session()
            return
        hashes = request.prefix_hashes
        if home != replica or not hashes:
            self._traffic.continued(None)
            return
        bt = request.block_tokens or 1
        turn = max(0, request.prompt_tokens - self.index.matched(replica, hashes) * bt)
        self._traffic.continued(float(turn))

    def finished(
        self, request: RouteRequest, replica: ReplicaId, ok: bool, latency_s: float
    ) -> None:
        self.prefilled(request)

    @property
    def unit_tokens(self) -> float:
        return max(_MIN_REQUEST_TOKENS, self._unit)

    # -- decision ----------------------------------------------------------------------

    def choose(self, request: RouteRequest, view: ClusterView) -> Choice:
        replicas = view.replicas
        if not replicas:
            return Choice((), "no_candidates", self.name)
        self._now = view.now
        self._refresh(view)
        key = request.session_key
        sticky = request.sticky_replica or self.sessions.replica_of(key, view.now)
        unit = self.unit_tokens
        if sticky is not None:
            replica = view.by_id.get(sticky)
            if replica is None:
                return self._place(request, view, unit, "failover")
            if self._evicted(request, sticky):
                return self._place(request, view, unit, "evicted")
            excess = self._excess_s(sticky, view)
            if excess <= self.config.stay_queue_s or excess <= self._recompute_s(request, sticky):
                return Choice(self._failover_order(sticky, key, view), "sticky", self.name)
            return self._place(request, view, unit, "bounded_load", avoid=sticky)
        return self._place(request, view, unit, "")

    def _evicted(self, request: RouteRequest, sticky: ReplicaId) -> bool:
        """The engines' own events say `sticky` no longer holds this session's prefix."""
        if self._evidence is None or not request.prefix_hashes:
            return False
        # The events' own answer, zeros included: a session whose prompt they hold nowhere
        # moves by load, which costs no cache when it was evicted everywhere (and keeping
        # such sessions put raised the one-gateway p99 by some 6 s on the synthetic trace).
        precise = self._evidence.cached_tokens(request)
        if not precise or sticky not in precise:
            return False
        held = precise[sticky]
        return held == 0 or held < self.config.evicted_fraction * max(precise.values())

    @staticmethod
    def _precise(evidence: CacheEvidence, request: RouteRequest) -> Mapping[ReplicaId, int] | None:
        """What the engines' events say each replica holds of the prompt, or None when
        they hold none of it anywhere: a prompt still in flight through another gateway
        (stored nowhere yet, and that gateway's dispatches are not seen here), or evicted
        everywhere. The prefix index then answers: it knows where the prompt was sent
        (shared through the store), and that is where its next turns cost no second copy."""
        precise = evidence.cached_tokens(request)
        if precise is None or not any(precise.values()):
            return None
        return precise

    def _load(self, replica: ReplicaId, view: ClusterView, unit: float) -> float:
        cfg = self.config
        return (
            self._pending.get(replica, 0.0)
            + _INFLIGHT_TOKENS * view.in_flight.get(replica, 0)
            + cfg.queue_weight * unit * self._queued.get(replica, 0.0)
        )

    def _over_queue(self, replica: ReplicaId, view: ClusterView) -> bool:
        """The prefill queued on `replica` is past the sticky bound (`_excess_s`)."""
        return self._excess_s(replica, view) > self.config.stay_queue_s

    def _recompute_s(self, request: RouteRequest, replica: ReplicaId) -> float:
        """Seconds another replica would take to recompute the prefix `replica` holds of
        this prompt, at the cluster's mean speed (only asked past the sticky bound: it
        walks the prompt's blocks)."""
        speed = self._mean_speed
        return self.cached_tokens(request, replica) / speed if speed else math.inf

    def _excess_s(self, replica: ReplicaId, view: ClusterView) -> float:
        """The prefill queued on `replica`, in seconds at its measured speed, less the
        cluster's mean queued seconds (-inf before any prefill speed is measured).
        O(1): per-replica and cluster totals kept at dispatch and first byte, no walk over
        the replicas.

        The speeds are the ones read when the view came (`_refresh`): the meter's mean is
        recomputed, a walk over the replicas, after every first token, and a replica with
        too few samples of its own answers with that mean."""
        prefill = view.prefill
        if prefill is None:
            return -math.inf
        mean_speed = self._mean_speed
        if not mean_speed:  # none was measured when this view came: perhaps one is now
            mean_speed = self._mean_speed = prefill.mean_speed()
            if not mean_speed:
                return -math.inf
            self._speeds = {}
        speed = self._speeds.get(replica) or mean_speed
        # What the engine reports waiting beyond the requests this gateway has queued
        # there is other gateways' work (or other clients'): each a mean request (the
        # policy's running mean, floored: the meter's starts at 0 and an engine swamped
        # at start-up must still shed its sessions).
        tokens = self._pending.get(replica, 0.0)
        beyond = self._queued.get(replica, 0.0) - prefill.queued_requests(replica)
        if beyond > 0:
            tokens += beyond * self.unit_tokens
        mean_s = (self._pending_total + self._beyond_tokens) / (len(view.replicas) * mean_speed)
        return tokens / speed - mean_s

    def _place(
        self,
        request: RouteRequest,
        view: ClusterView,
        unit: float,
        moved: str,
        avoid: ReplicaId | None = None,
    ) -> Choice:
        """Rank by cost; `avoid` (the replica over the load bound) goes last: its cache
        would otherwise win it back the session the bound just moved."""
        cfg = self.config
        replicas = view.replicas
        hashes = request.prefix_hashes
        bt = request.block_tokens or 1
        prompt = request.prompt_tokens
        position = {r.id: i for i, r in enumerate(replicas)} if hashes else {}
        matched = self.index.matched_sparse(position, hashes) if hashes else {}
        evidence = self._evidence
        precise = None
        if evidence is not None and hashes:
            # A session the events say its replica evicted goes by their zeros (by load):
            # the prefix index would send it straight back to where it is gone.
            raw = moved == "evicted"
            precise = evidence.cached_tokens(request) if raw else self._precise(evidence, request)
        pending, queued, counts = self._pending.get, self._queued.get, self.sessions.counts.get
        inflight = view.in_flight.get
        qw = cfg.queue_weight * unit
        cw = cfg.cache_weight
        sh = self._tie.session_hash(request.session_key)
        rh = self._tie.replica_hash
        # Live sessions (each will send more turns) break ties of cost, then the hash.
        keys: list[tuple[float, int, int, int]] = []
        in_band = self._band(request, view, matched) if not moved else None
        hot = in_band is not None
        if hot and self._deep(request, view, unit, matched, precise):
            in_band = None  # one conversation's history, not a preamble: follow it
        # A new session from a prefix that is not hot weighs a token it would recompute on
        # r by what that costs there (kv_pressure): 1 + 1/n while r's KV keeps what its
        # sessions come back for, up to cache_weight once it does not. Everywhere else
        # (a hot or deep prefix, a moved session) the prefix's pull stays cache_weight.
        pressure = self._pressure if not moved and not hot and self._pressure.mean_gap_s else None
        capacity, default_capacity = self._capacity_seen.get, cfg.default_capacity_tokens
        pinned = self._pinned.get
        n, now = len(replicas), self._now
        # Live sessions weigh as future load in the band and for a moved session; a new
        # session with no hot prefix goes by the load now, its ties to fewer sessions.
        per_session = 0.0 if in_band is None and not moved else _SESSION_WEIGHT * unit
        # A session moved by the bound goes by load; one from a hot preamble by the band.
        held: dict[int, int] = {}
        for i, r in enumerate(replicas):
            rid = r.id
            if precise is not None and rid in precise:
                cached = min(prompt, precise[rid])
            else:
                cached = min(prompt, matched.get(i, 0) * bt)
            weight = cw
            if pressure is not None and prompt > cached:
                # What running requests hold (the engine's KV usage; vLLM's counts cached
                # blocks no request holds as free) is not there for the cache.
                free = (capacity(rid) or default_capacity) * (1.0 - pinned(rid, 0.0))
                level = pressure.of(rid, free, now)
                weight = token_weight(level, n, cw)
            cost = (
                pending(rid, 0.0)
                + _INFLIGHT_TOKENS * inflight(rid, 0)
                + qw * queued(rid, 0.0)
                + weight * (prompt - cached)
                + per_session * counts(rid, 0)
            ) / (r.weight if r.weight > 0 else 1.0)
            if in_band is not None and rid not in in_band:
                cost += 1e18  # outside the band: only as a failover
            if cached:
                held[i] = cached
            keys.append((cost, counts(rid, 0), mix(sh, rh(rid)), i))
        best = heapq.nsmallest(RANK_DEPTH, keys) if len(keys) > RANK_DEPTH else sorted(keys)
        ranked = tuple(replicas[key[3]].id for key in best)
        if avoid is not None and avoid in ranked:
            ranked = (*(r for r in ranked if r != avoid), avoid)
        if moved:
            reason = moved
        else:
            reason = "prefix" if held.get(best[0][3], 0) else "least_cost"
        return Choice(ranked, reason, self.name)

    def _deep(
        self,
        request: RouteRequest,
        view: ClusterView,
        unit: float,
        matched: dict[int, int],
        precise: Mapping[ReplicaId, int] | None,
    ) -> bool:
        """The prefix the best replica holds beyond what most replicas hold is longer
        than what a new session will send later, and that replica is within the load
        bound: spreading would recompute more than it balances (only on the band's path)."""
        owed = self._traffic.owed()
        if owed is None:
            return False
        replicas = view.replicas
        prompt = request.prompt_tokens
        bt = request.block_tokens or 1
        cached = []
        for i, r in enumerate(replicas):
            if precise is not None and r.id in precise:
                cached.append(min(prompt, precise[r.id]))
            else:
                cached.append(min(prompt, matched.get(i, 0) * bt))
        at, deeper = beyond_common(cached)
        if deeper <= owed:
            return False
        holder = replicas[at].id
        if self._over_queue(holder, view):
            return False
        # Tokens for tokens: waiting behind the holder's queue beyond the least loaded
        # replica's must cost less than recomputing the prefix it saves. Live sessions
        # count as the work their further turns will bring (`owed`): without them one
        # agent kind's sessions all followed its 28K-token preamble to one replica, 13-15
        # of its 17 (issue 45, fifth). Not a floor of a mean prefill each: where sessions
        # send little after their first request, a conversation's own four forks then
        # outweighed its 3K-token history and its resume left it.
        per_session = owed
        counts = self.sessions.counts.get
        load = self._load(holder, view, unit) + per_session * counts(holder, 0)
        least = min(self._load(r.id, view, unit) + per_session * counts(r.id, 0) for r in replicas)
        return load - least <= deeper

    def _band(
        self, request: RouteRequest, view: ClusterView, matched: dict[int, int]
    ) -> frozenset[ReplicaId] | None:
        """The replicas a new session from a hot prefix may go to, or None (no band)."""
        cfg = self.config
        if cfg.session_band is None or not matched:
            return None
        depth = max(matched.values())
        if self._branches.sessions_at(request.prefix_hashes, depth) < cfg.hot_after:
            return None
        replicas = view.replicas
        counts, tokens = self.sessions.counts.get, self.sessions.tokens.get
        live = [counts(r.id, 0) for r in replicas]
        mass = [tokens(r.id, 0) for r in replicas]
        return band(replicas, live, mass, cfg.session_band)

    def _failover_order(
        self, first: ReplicaId, key: str, view: ClusterView
    ) -> tuple[ReplicaId, ...]:
        by_id = view.by_id
        want = min(RANK_DEPTH, len(by_id))
        order = [first]
        if want > 1:
            # The walk stops once every ring member was seen: a member missing from the view
            # (or a one-replica ring) would otherwise walk all its virtual nodes per request.
            ring = self._ring
            members = len(ring.members)
            seen: set[ReplicaId] = set()
            for rid in ring.clockwise(key):
                if rid in seen:
                    continue
                seen.add(rid)
                if rid != first and rid in by_id:
                    order.append(rid)
                    if len(order) >= want:
                        break
                if len(seen) >= members:
                    break
        if len(order) < want:
            # Replicas the ring was not told about (views built by hand).
            order.extend(r.id for r in view.replicas if r.id not in order)
        return tuple(order[:RANK_DEPTH])

    def _refresh(self, view: ClusterView) -> None:
        """Per-view data (scraped queues, KV capacities), rebuilt when the view changes."""
        self._evidence = view.cache_evidence
        if view.replicas is self._view_key and view.prefill is self._view_prefill:
            return
        self._view_key, self._view_prefill = view.replicas, view.prefill
        queued: dict[ReplicaId, float] = {}
        pinned: dict[ReplicaId, float] = {}
        for r in view.replicas:
            load = view.load_of(r)
            if load is not None:
                if load.waiting:
                    queued[r.id] = load.waiting
                if load.kv_usage:
                    pinned[r.id] = load.kv_usage
            capacity = (r.load.kv_capacity_tokens if r.load is not None else None) or (
                r.kv_capacity_tokens
            )
            if capacity and self._capacity_seen.get(r.id) != capacity:
                self._capacity_seen[r.id] = capacity
                self.index.set_capacity(r.id, capacity, self._block_tokens)
        self._queued, self._pinned = queued, pinned
        prefill = view.prefill
        # The meter recomputes its mean after every sample (a walk over the replicas):
        # read once per view, not on every sticky decision.
        self._mean_speed = prefill.mean_speed() if prefill is not None else None
        self._speeds = {}
        if prefill is not None and self._mean_speed:
            speed = prefill.speed
            self._speeds = {r.id: s for r in view.replicas if (s := speed(r.id))}
        # The cluster's side of the engines' queues beyond this gateway's, per view.
        beyond = 0.0
        if prefill is not None and queued:
            per_request = self.unit_tokens
            for rid, waiting in queued.items():
                beyond += max(0.0, waiting - prefill.queued_requests(rid)) * per_request
        self._beyond_tokens = beyond
