"""`PoolSelector`: a policy wrapper that picks a card pool, then lets the inner policy pick
the replica inside it.

Per request (cost: O(replicas) plus one inner `choose` per allowed pool):
1. `Placement.place` keeps only healthy replicas of pools allowed to serve the model
   (404/503 otherwise). Nothing outside that set is ever ranked, even under overload.
2. The pool: the most specific matching rule's first unsaturated preferred pool; else the
   pool the session already lives on, unless it is saturated or (with
   `session_idle_release_s`) the session sat idle that long and the weights now send it
   elsewhere; else the dynamic weights, split by a hash of the session key so a session
   lands on the same pool every time.
3. The pool's own instance of the inner policy (one per pool, so rings and prefix indexes
   stay per pool) ranks a view restricted to that pool; the other allowed pools follow as a
   failover tail (unsaturated first, heavier weight first).

With `spill_new_sessions_at`, a new session (no home pool) whose weighted pool has that
many requests in flight on every replica goes to another allowed pool with room (`spill`),
and inside its pool a replica with room is ranked first.

With `new_sessions_pool`, a new session starts on that pool while it is not saturated (a
matching rule still wins).

`warm_move` answers the prefix warmer (gateway.pools.warm): whether a session that just
ran should follow the weights to another pool, and which idle replica there to warm first.

`Choice.reason` is `<pool>:<why>:<inner reason>`, with `why` one of rule_tenant,
rule_class, session, weights, weights_home_saturated, weights_idle_release, new_session,
spill, all_saturated:
a small label set,
since the proxy counts decisions by reason.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import ClassVar

import xxhash

from gateway.errors import GatewayError
from gateway.policy import (
    EstimatesCachedTokens,
    ObservesOutcome,
    ObservesPlacement,
    Policy,
    ReactsToMembership,
    TracksPrefill,
)
from gateway.pools.config import PoolRule, PoolsSettings
from gateway.pools.controller import WeightSnapshot
from gateway.pools.placement import Placement
from gateway.pools.utilisation import replica_utilisation
from gateway.types import Choice, ClusterView, ReplicaId, ReplicaState, RouteRequest

_UNPOOLED = ""
_HASH_SPAN = float(2**64)


def session_point(session_key: str) -> float:
    """Where a session falls on [0, 1): stable across processes and restarts."""
    return xxhash.xxh3_64_intdigest(session_key.encode()) / _HASH_SPAN


def split_by_weight(point: float, weights: Sequence[tuple[str, float]]) -> str:
    """The pool whose cumulative-weight interval holds `point` (weights need not sum to 1)."""
    total = sum(w for _, w in weights)
    if total <= 0:
        return weights[int(point * len(weights))][0]
    edge = 0.0
    for name, weight in weights:
        edge += weight / total
        if point < edge:
            return name
    return weights[-1][0]


class PoolSelector:
    """Pool choice in front of any policy (see module docstring)."""

    name: ClassVar[str] = "pools"
    cached_tokens: Callable[[RouteRequest, ReplicaId], int]

    def __init__(
        self,
        inner_factory: Callable[[tuple[ReplicaState, ...]], Policy],
        settings: PoolsSettings,
        weights: Callable[[], WeightSnapshot],
        replicas: Sequence[ReplicaState] = (),
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._inner_factory = inner_factory
        self._inners: dict[str, Policy] = {}
        self._subviews: tuple[tuple[ReplicaState, ...], dict[str, ClusterView]] = ((), {})
        self.placement = Placement(settings)
        self._settings = settings
        self._weights = weights
        self._specs = {p.name: p for p in settings.pools}
        self._rules = sorted(enumerate(settings.rules), key=lambda ir: (-ir[1].specificity, ir[0]))
        # session key -> (pool, clock time of its last placement)
        self._sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._replica_pool: dict[ReplicaId, str] = {}
        self.membership_changed(replicas)
        # Every pool runs the same policy: when it estimates cached tokens, so does the
        # selector (set only then, so `isinstance(selector, EstimatesCachedTokens)` stays
        # truthful and PD keeps its own index otherwise). Admission and engine priority
        # rank by it; without it every turn of a long conversation would look uncached.
        probe = next(iter(self._inners.values()), None) or inner_factory(())
        if isinstance(probe, EstimatesCachedTokens):
            self.cached_tokens = self._cached_tokens

    # -- choose ---------------------------------------------------------------------------

    def choose(self, request: RouteRequest, view: ClusterView) -> Choice:
        target, candidates = self.placement.place(request.model, view, request.prompt_tokens)
        groups: dict[str, list[ReplicaState]] = {}
        for replica in candidates:
            groups.setdefault(replica.pool or _UNPOOLED, []).append(replica)
        util = {g: self._group_util(g, rs, view) for g, rs in groups.items()}
        saturation = self._settings.controller.saturation
        saturated = {g for g, u in util.items() if u >= saturation}
        snap = self._weights()
        pool, why = self._pick_pool(request, view, groups, saturated, util, snap)

        inner_request = (
            request if target.served == request.model else replace(request, model=target.served)
        )
        tail = sorted(
            (g for g in groups if g != pool),
            key=lambda g: (g in saturated, -snap.weights.get(g, 0.0), util[g], g),
        )
        ranked: list[ReplicaId] = []
        inner_reason = ""
        spill = self._settings.spill_new_sessions_at
        for group in (pool, *tail):
            ids, reason = self._rank_within(group, inner_request, view, groups[group])
            if group == pool:
                inner_reason = reason
                if spill is not None and why in ("weights", "spill"):
                    # New session: a replica with room first, the inner order otherwise.
                    ids.sort(key=lambda r: view.inflight(r) >= spill)
            ranked.extend(ids)
        if not ranked:
            # The inner policy declined every capable replica (its own saturation filter):
            # still offer them, least utilised first, rather than drop the request.
            ranked = [r.id for r in sorted(candidates, key=lambda r: self._util(r, view))]
            inner_reason = "least_utilised"
        inner_name = self._inner(pool).name
        return Choice(
            tuple(ranked),
            reason=f"{pool or '-'}:{why}:{inner_reason}",
            policy=f"{self.name}+{inner_name}",
        )

    def _pick_pool(
        self,
        request: RouteRequest,
        view: ClusterView,
        groups: dict[str, list[ReplicaState]],
        saturated: set[str],
        util: dict[str, float],
        snap: WeightSnapshot,
    ) -> tuple[str, str]:
        for _, rule in self._rules:
            if not self._matches(rule, request):
                continue
            for pool in rule.prefer:
                if pool in groups and pool not in saturated:
                    return pool, "rule_tenant" if rule.tenant is not None else "rule_class"
        home, idle = self._home_pool(request, view)
        open_groups = [g for g in sorted(groups) if g not in saturated]
        split = [(g, snap.weights.get(g, 0.0)) for g in open_groups]
        by_weight = split_by_weight(session_point(request.session_key), split) if split else None
        if home is not None and home in groups and home not in saturated:
            release = self._settings.session_idle_release_s
            # An idle session whose KV is likely gone anyway follows the weights; an active
            # one stays where its prefix lives.
            if release is None or idle < release or by_weight in (None, home):
                return home, "session"
            return by_weight, "weights_idle_release"
        if by_weight is None:
            pool = min(groups, key=lambda g: (util[g], g))
            return pool, "all_saturated"
        if home is not None and home in saturated:
            return by_weight, "weights_home_saturated"
        start = self._settings.new_sessions_pool
        if home is None and start is not None and start in groups and start not in saturated:
            # The first turn is the session's one uncached prefill: on the fast cards it
            # costs little latency; warm moves can then take the session where the
            # weights want it.
            return start, "new_session"
        spill = self._settings.spill_new_sessions_at
        if (
            home is None
            and spill is not None
            and not self._has_room(groups[by_weight], view, spill)
        ):
            # A new session's first turn is its one uncached prefill: better on an idle
            # replica of another pool than queued behind a busy one of the weighted pool.
            roomy = [
                g for g in open_groups if g != by_weight and self._has_room(groups[g], view, spill)
            ]
            if roomy:
                return max(roomy, key=lambda g: (snap.weights.get(g, 0.0), -util[g], g)), "spill"
        return by_weight, "weights"

    def warm_move(
        self, request: RouteRequest, served_on: ReplicaId, view: ClusterView
    ) -> tuple[str, ReplicaId | None] | None:
        """For `warm_moves`: None when a session that just ran on `served_on` should stay;
        else the pool the weights now give it and where to prefill its prompt there first,
        an idle replica ranked by that pool's inner policy (None: none is idle now)."""
        found = self._warm_move(request, served_on, view)
        if found is None:
            return None
        pool, served, groups = found
        inner_request = request if served == request.model else replace(request, model=served)
        ids, _ = self._rank_within(pool, inner_request, view, groups[pool])
        # Only an idle replica: a warm-up's prefill must not queue ahead of live requests.
        return pool, next((r for r in ids if view.inflight(r) == 0), None)

    def move_buys_latency_only(self, served_on: ReplicaId, pool: str) -> bool:
        """True when moving a session from `served_on`'s pool onto `pool` would pay a higher
        replica-hour price while its own pool is not under pressure (smoothed utilisation
        under the high watermark). Such a move costs a prefill on the pricier cards and buys
        nothing: the weights lag the load on purpose, so after a peak they still point at
        the pricier pool for a while, and a session moved then is soon moved back."""
        home = self._replica_pool.get(served_on)
        source, target = self._specs.get(home or _UNPOOLED), self._specs.get(pool)
        if source is None or target is None:
            return False
        if target.price_per_replica_hour <= source.price_per_replica_hour:
            return False
        util = self._weights().utilisation.get(source.name)
        return util is not None and util < self._settings.controller.high_watermark

    def _warm_move(
        self, request: RouteRequest, served_on: ReplicaId, view: ClusterView
    ) -> tuple[str, str, dict[str, list[ReplicaState]]] | None:
        """(pool to move to, served model name, open pools) or None to stay."""
        home = self._replica_pool.get(served_on)
        if home is None:
            return None
        remembered = self._sessions.get(request.session_key)
        if remembered is not None and remembered[0] != home:
            return None  # the session has moved on since that turn
        if any(self._matches(rule, request) for _, rule in self._rules):
            return None  # a rule places this class or tenant, not the weights
        found = self._open_groups(request, view)
        if found is None:
            return None
        served, groups = found
        snap = self._weights()
        split = [(g, snap.weights.get(g, 0.0)) for g in sorted(groups)]
        pool = split_by_weight(session_point(request.session_key), split)
        return None if pool == home else (pool, served, groups)

    def _open_groups(
        self, request: RouteRequest, view: ClusterView
    ) -> tuple[str, dict[str, list[ReplicaState]]] | None:
        """The served model name and the unsaturated pools allowed to serve it."""
        try:
            target, candidates = self.placement.place(request.model, view, request.prompt_tokens)
        except GatewayError:
            return None
        groups: dict[str, list[ReplicaState]] = {}
        for replica in candidates:
            groups.setdefault(replica.pool or _UNPOOLED, []).append(replica)
        saturation = self._settings.controller.saturation
        open_groups = {
            g: rs for g, rs in groups.items() if self._group_util(g, rs, view) < saturation
        }
        return (target.served, open_groups) if open_groups else None

    @staticmethod
    def _has_room(replicas: list[ReplicaState], view: ClusterView, busy_at: int) -> bool:
        return any(view.inflight(r.id) < busy_at for r in replicas)

    def _rank_within(
        self, group: str, request: RouteRequest, view: ClusterView, allowed: list[ReplicaState]
    ) -> tuple[list[ReplicaId], str]:
        try:
            choice = self._inner(group).choose(request, self._subview(group, view))
        except GatewayError as exc:  # the inner router found nothing usable in this pool
            return [], exc.message
        ids = {r.id for r in allowed}
        return [r for r in choice.ranked if r in ids], choice.reason

    def _subview(self, group: str, view: ClusterView) -> ClusterView:
        """The pool's part of the view. Its replica tuple keeps its identity while the
        cluster's does, so inner policies that rebuild on membership change stay O(1)."""
        source, cache = self._subviews
        if source is not view.replicas:
            cache = {}
            self._subviews = (view.replicas, cache)
        base = cache.get(group)
        if base is None:
            members = tuple(r for r in view.replicas if (r.pool or _UNPOOLED) == group)
            base = cache[group] = ClusterView(replicas=members)
        return ClusterView(
            replicas=base.replicas,
            now=view.now,
            stale_after=view.stale_after,
            in_flight=view.in_flight,
            by_id=base.by_id,
            cache_evidence=view.cache_evidence,
        )

    def _inner(self, group: str) -> Policy:
        inner = self._inners.get(group)
        if inner is None:
            inner = self._inners[group] = self._inner_factory(())
        return inner

    def _home_pool(self, request: RouteRequest, view: ClusterView) -> tuple[str | None, float]:
        """The session's pool and how long since it was last placed (0 when unknown: a
        session-store placement carries no age, so it is treated as active)."""
        remembered = self._sessions.get(request.session_key)
        if remembered is not None:
            pool, last = remembered
            return pool, self._clock() - last
        if request.sticky_replica is not None:
            replica = view.by_id.get(request.sticky_replica)
            if replica is not None:
                return replica.pool or _UNPOOLED, 0.0
        return None, 0.0

    def _group_util(self, group: str, replicas: list[ReplicaState], view: ClusterView) -> float:
        return sum(self._util(r, view) for r in replicas) / len(replicas)

    def _util(self, replica: ReplicaState, view: ClusterView) -> float:
        spec = self._specs.get(replica.pool or _UNPOOLED)
        slots = spec.slots_per_replica if spec is not None else 1
        return replica_utilisation(replica, view, slots)

    @staticmethod
    def _matches(rule: PoolRule, request: RouteRequest) -> bool:
        if rule.tenant is not None and rule.tenant != request.tenant:
            return False
        return rule.priority_class is None or rule.priority_class == request.priority_class

    # -- optional abilities, forwarded to the inner policy ---------------------------------

    def _served(self, request: RouteRequest) -> RouteRequest:
        served = self.placement.served_name(request.model)
        return request if served == request.model else replace(request, model=served)

    def placed(self, request: RouteRequest, replica: ReplicaId) -> None:
        pool = self._replica_pool.get(replica)
        if pool is None:
            return
        limit = self._settings.session_memory
        if limit > 0:
            self._sessions[request.session_key] = (pool, self._clock())
            self._sessions.move_to_end(request.session_key)
            while len(self._sessions) > limit:
                self._sessions.popitem(last=False)
        inner = self._inners.get(pool)
        if isinstance(inner, ObservesPlacement):
            inner.placed(self._served(request), replica)

    def finished(
        self, request: RouteRequest, replica: ReplicaId, ok: bool, latency_s: float
    ) -> None:
        inner = self._inners.get(self._replica_pool.get(replica, _UNPOOLED))
        if isinstance(inner, ObservesOutcome):
            inner.finished(self._served(request), replica, ok, latency_s)

    def _cached_tokens(self, request: RouteRequest, replica: ReplicaId) -> int:
        inner = self._inners.get(self._replica_pool.get(replica, _UNPOOLED))
        if isinstance(inner, EstimatesCachedTokens):
            return inner.cached_tokens(self._served(request), replica)
        return 0

    def dispatched(self, request: RouteRequest, replica: ReplicaId) -> None:
        inner = self._inners.get(self._replica_pool.get(replica, _UNPOOLED))
        if isinstance(inner, TracksPrefill):
            inner.dispatched(self._served(request), replica)

    def prefilled(self, request: RouteRequest) -> None:
        # The pool is not known here; `prefilled` is idempotent, so every inner is told.
        for inner in self._inners.values():
            if isinstance(inner, TracksPrefill):
                inner.prefilled(request)

    def membership_changed(self, replicas: Sequence[ReplicaState]) -> None:
        self._replica_pool = {r.id: r.pool or _UNPOOLED for r in replicas}
        groups: dict[str, list[ReplicaState]] = {}
        for r in replicas:
            groups.setdefault(r.pool or _UNPOOLED, []).append(r)
        for group, members in groups.items():
            inner = self._inners.get(group)
            if inner is None:
                self._inners[group] = self._inner_factory(tuple(members))
            elif isinstance(inner, ReactsToMembership):
                inner.membership_changed(members)

    def pool_of(self, replica: ReplicaId) -> str | None:
        return self._replica_pool.get(replica)
