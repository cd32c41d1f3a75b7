"""`cost`: every request goes where its first token comes soonest, counted in seconds.

One currency. For a candidate replica ``r`` the estimated wait for this request's first
token is

    wait_r = (queued_r + own_r + owed_r) / speed_r + lost_r / mean_speed

* ``queued_r``: prefill queued ahead of it there, in tokens: the uncached prompt tokens
  this gateway sent to r that have no first token yet, plus, for each request the engine
  reports waiting beyond those, one mean uncached request (both from ``view.prefill``);
* ``own_r``: this request's uncached prefill there (its prompt minus what r's prefix
  index, or r's KV events, say r holds). A request counts as held on its replica the
  moment it is dispatched, so a burst that extends one prefix (forks, ``n > 1`` sent as
  separate requests) finds it where the first of them went;
* ``owed_r``: the prefill r owes its live sessions' next turns: sessions there that have
  sent a second request and were seen within three mean gaps between a session's turns,
  times the mean uncached prefill of a turn that continues a session on its replica (both
  measured here from placements);
* ``speed_r``: r's prefill speed in tokens per second, measured online from its answers
  (gateway.prefill_meter; the cluster's mean for a replica not measured yet; with no
  measurement at all every replica counts alike and the sum is in tokens);
* ``lost_r``: what recomputing a prefix another replica holds costs the cluster: the best
  cached prefix anywhere minus r's. A shared preamble every replica holds costs nothing
  anywhere and pulls no one; a deep history held by one replica pulls its forks there
  until that replica's queue outweighs recomputing it.

Stickiness: a session placed before (the store's placement, else this policy's table of
live sessions) stays on its replica while the prefill queued there is at most
``stay_queue_s`` seconds; past that it is ranked by the wait above like any request (so it
stays when its cache still makes its replica the soonest). With KV cache events a sticky
replica holding less than ``evicted_fraction`` of the best replica's prefix counts as
having evicted it (reason ``evicted``).

The policy reads only the view (``view.prefill`` is built outside it, by the gateway or
the simulator); its own state is the prefix index and the live-session table, updated by
``placed``. Reasons: ``sticky``, ``queued`` (moved by the bound), ``failover``,
``evicted``, ``prefix``, ``least_wait``, ``no_candidates``.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from typing import ClassVar

from pydantic import Field

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
from plugins.live_sessions import LiveSessions
from plugins.load_model import TieBreaker, mix
from plugins.prefix_index import DEFAULT_CAPACITY_TOKENS, PrefixIndex

# Smoothing of the measured means of a continued turn's uncached prefill and of the gap
# between a session's turns (per turn), and how many gaps a session stays active for.
_TURN_ALPHA = 0.05
_ACTIVE_GAPS = 3.0


class CostConfig(PolicyConfig):
    stay_queue_s: float = Field(
        default=4.0,
        ge=0,
        description="seconds of prefill queued on a session's replica up to which the "
        "session stays there without comparing (measured: docs/routing.md)",
    )
    session_idle_s: float = Field(
        default=900.0, gt=0, description="seconds after which an unseen session is not live"
    )
    max_sessions: int = Field(default=1 << 18, ge=1, description="live sessions remembered")
    default_capacity_tokens: int = Field(
        default=DEFAULT_CAPACITY_TOKENS, ge=1, description="KV tokens when not scraped"
    )
    index_capacity_factor: float = Field(
        default=4.0,
        gt=0,
        description="prefix index size over the replica's KV tokens: it remembers where "
        "prompts went longer than engines keep them",
    )
    vnodes: int = Field(default=DEFAULT_VNODES, ge=1, description="failover ring vnodes")
    evicted_fraction: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="with KV cache events: a sticky replica holding less than this share "
        "of the best replica's cached prefix counts as having evicted the session",
    )


class Cost:
    name: ClassVar[str] = "cost"
    Config: ClassVar[type[CostConfig]] = CostConfig
    handles_saturation: ClassVar[bool] = True  # queued seconds bound the sticky replica

    def __init__(self, config: CostConfig, context: PolicyContext) -> None:
        self.config = config
        self.index = PrefixIndex(config.default_capacity_tokens, config.index_capacity_factor)
        self.sessions = LiveSessions(config.session_idle_s, config.max_sessions)
        self._tie = TieBreaker()
        self._ring = HashRing((), config.vnodes)
        self._now = 0.0
        self._turn_tokens: float | None = None
        self._gap_s: float | None = None
        # Sessions that still send turns (seen within _ACTIVE_GAPS mean gaps): what is owed.
        self.active = LiveSessions(config.session_idle_s, config.max_sessions)
        self._view_key: tuple[ReplicaState, ...] | None = None
        self._capacity_seen: dict[ReplicaId, int] = {}
        self._block_tokens = 512
        self._evidence: CacheEvidence | None = None
        self.membership_changed(context.replicas)

    # -- abilities ---------------------------------------------------------------------

    def membership_changed(self, replicas: Sequence[ReplicaState]) -> None:
        live = {r.id for r in replicas}
        for gone in set(self._ring.members) - live:
            self.index.forget(gone)
            self.sessions.forget(gone)
            self.active.forget(gone)
            self._capacity_seen.pop(gone, None)
        self._ring = HashRing((RingNode(r.id, r.weight) for r in replicas), self.config.vnodes)
        for r in replicas:
            if r.kv_capacity_tokens:
                self.index.set_capacity(r.id, r.kv_capacity_tokens, self._block_tokens)
                self._capacity_seen.setdefault(r.id, r.kv_capacity_tokens)

    def cached_tokens(self, request: RouteRequest, replica: ReplicaId) -> int:
        """Leading prompt tokens `replica` likely holds (the meter, admission, PD ask)."""
        hashes = request.prefix_hashes
        if not hashes:
            return 0
        if self._evidence is not None:
            precise = _precise(self._evidence, request)
            if precise is not None and replica in precise:
                return min(precise[replica], request.prompt_tokens or precise[replica])
        tokens = self.index.matched(replica, hashes) * request.block_tokens
        return min(tokens, request.prompt_tokens) if request.prompt_tokens else tokens

    def placed(self, request: RouteRequest, replica: ReplicaId) -> None:
        hashes = request.prefix_hashes
        key = request.session_key
        now = self._now
        last = self.sessions.last_seen(key, now)
        if last is not None and self.sessions.replica_of(key, now) == replica:
            # A turn continuing a session where it lives: what live sessions owe, and when.
            turn = max(0, request.prompt_tokens - self.cached_tokens(request, replica))
            gap = now - last
            if self._turn_tokens is None or self._gap_s is None:
                self._turn_tokens, self._gap_s = float(turn), gap
            else:
                self._turn_tokens += _TURN_ALPHA * (turn - self._turn_tokens)
                self._gap_s += _TURN_ALPHA * (gap - self._gap_s)
            self.active.idle_s = min(self.config.session_idle_s, _ACTIVE_GAPS * self._gap_s)
        if hashes:
            self._block_tokens = request.block_tokens or 1
            self.index.record(replica, hashes, self._block_tokens)
        self.sessions.place(key, replica, now, request.prompt_tokens)
        if last is not None:
            # Only a session that has sent a second request owes turns: counting every
            # one-shot request (a job, a fork, a sample) as owing the mean turn charged
            # the replica a burst's prefix is on for work that never comes, and how many
            # of them were still "active" (within three mean gaps) depended on timing.
            self.active.place(key, replica, now)

    # -- decision ----------------------------------------------------------------------

    def choose(self, request: RouteRequest, view: ClusterView) -> Choice:
        if not view.replicas:
            return Choice((), "no_candidates", self.name)
        self._now = view.now
        self._refresh(view)
        key = request.session_key
        sticky = request.sticky_replica or self.sessions.replica_of(key, view.now)
        if sticky is None:
            return self._rank(request, view, "")
        replica = view.by_id.get(sticky)
        if replica is None:
            return self._rank(request, view, "failover")
        if self._evicted(request, sticky):
            return self._rank(request, view, "evicted")
        prefill = view.prefill
        if prefill is None or self._queued_s(prefill, replica, view) <= self.config.stay_queue_s:
            return Choice(self._failover_order(sticky, key, view), "sticky", self.name)
        return self._rank(request, view, "queued")

    @staticmethod
    def _queued_tokens(prefill: PrefillSignals, replica: ReplicaState, view: ClusterView) -> float:
        rid = replica.id
        tokens = prefill.queued_tokens(rid)
        load = view.load_of(replica)
        if load is not None and load.waiting:
            # Waiting requests beyond this gateway's own (other clients, other gateways).
            extra = load.waiting - prefill.queued_requests(rid)
            if extra > 0:
                tokens += extra * prefill.mean_request_tokens()
        return tokens

    def _queued_s(self, prefill: PrefillSignals, replica: ReplicaState, view: ClusterView) -> float:
        speed = prefill.speed(replica.id)
        if not speed:
            return 0.0  # nothing measured yet: no basis to move anyone
        return self._queued_tokens(prefill, replica, view) / speed

    def _evicted(self, request: RouteRequest, sticky: ReplicaId) -> bool:
        if self._evidence is None or not request.prefix_hashes:
            return False
        precise = self._evidence.cached_tokens(request)
        if not precise or sticky not in precise:
            return False
        held = precise[sticky]
        return held == 0 or held < self.config.evicted_fraction * max(precise.values())

    def _rank(self, request: RouteRequest, view: ClusterView, moved: str) -> Choice:
        replicas = view.replicas
        hashes = request.prefix_hashes
        bt = request.block_tokens or 1
        prompt = request.prompt_tokens
        position = {r.id: i for i, r in enumerate(replicas)} if hashes else {}
        matched = self.index.matched_sparse(position, hashes) if hashes else {}
        precise = None
        if self._evidence is not None and hashes:
            raw = moved == "evicted"
            ev = self._evidence
            precise = ev.cached_tokens(request) if raw else _precise(ev, request)
        cached: list[int] = []
        for i, r in enumerate(replicas):
            if precise is not None and r.id in precise:
                cached.append(min(prompt, precise[r.id]))
            else:
                held = matched.get(i, 0) * bt
                cached.append(min(prompt, held) if prompt else held)
        best_cached = max(cached)
        prefill = view.prefill
        mean_speed = (prefill.mean_speed() if prefill is not None else None) or 1.0
        # Lost work is paid in the whole cluster's time: tokens over its total speed.
        cluster_speed = mean_speed * len(replicas)
        self.active.expire(view.now)
        counts = self.active.counts.get
        turn = self._turn_tokens or 0.0
        sh = self._tie.session_hash(request.session_key)
        rh = self._tie.replica_hash
        keys: list[tuple[float, int, int]] = []
        for i, r in enumerate(replicas):
            rid = r.id
            if prefill is not None:
                speed = prefill.speed(rid) or mean_speed
                queued = self._queued_tokens(prefill, r, view)
            else:
                speed, queued = mean_speed, float(view.in_flight.get(rid, 0) * turn)
            own = max(0, prompt - cached[i])
            owed = counts(rid, 0) * turn
            wait = (queued + own + owed) / speed + (best_cached - cached[i]) / cluster_speed
            keys.append((wait, mix(sh, rh(rid)), i))
        best = heapq.nsmallest(RANK_DEPTH, keys) if len(keys) > RANK_DEPTH else sorted(keys)
        ranked = tuple(replicas[i].id for _, _, i in best)
        reason = moved or ("prefix" if cached[best[0][2]] else "least_wait")
        return Choice(ranked, reason, self.name)

    def _failover_order(
        self, first: ReplicaId, key: str, view: ClusterView
    ) -> tuple[ReplicaId, ...]:
        by_id = view.by_id
        order = [first]
        depth = min(RANK_DEPTH, len(by_id))
        for rid in self._ring.clockwise(key):
            if rid != first and rid in by_id and rid not in order:
                order.append(rid)
                if len(order) >= depth:
                    break
        if len(order) < depth:
            order.extend(r.id for r in view.replicas if r.id not in order)
        return tuple(order[:RANK_DEPTH])

    def _refresh(self, view: ClusterView) -> None:
        self._evidence = view.cache_evidence
        if view.replicas is self._view_key:
            return
        self._view_key = view.replicas
        for r in view.replicas:
            capacity = (r.load.kv_capacity_tokens if r.load is not None else None) or (
                r.kv_capacity_tokens
            )
            if capacity and self._capacity_seen.get(r.id) != capacity:
                self._capacity_seen[r.id] = capacity
                self.index.set_capacity(r.id, capacity, self._block_tokens)


def _precise(evidence: CacheEvidence, request: RouteRequest) -> Mapping[ReplicaId, int] | None:
    """The events' answer, or None when they hold none of the prompt anywhere (in flight
    through another gateway, or evicted everywhere): the prefix index answers then."""
    precise = evidence.cached_tokens(request)
    if precise is None or not any(precise.values()):
        return None
    return precise
