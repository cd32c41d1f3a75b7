"""Live cluster state and the immutable `ClusterView` snapshots the policies read.

Writers (health monitor, scraper, model discovery, membership changes) mutate through the
methods here; each change marks the view dirty and the next `view()` call builds a new
frozen snapshot. Requests otherwise get the same object back, so routing allocates nothing
per request for the view. `in_flight` is a read-only proxy over the live counters.

Clock: `scraped_at` of published loads must come from the same clock as `Cluster.clock`
(time.monotonic by default), because staleness is judged against `view().now`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from types import MappingProxyType

from gateway.prefill_meter import PrefillMeter
from gateway.types import CacheEvidence, ClusterView, EngineLoad, ReplicaId, ReplicaState

# A cached view older than this is rebuilt anyway, so load staleness (judged against
# view.now) still shows when every writer has gone quiet.
VIEW_MAX_AGE_S = 0.25

MembershipListener = Callable[[tuple[ReplicaState, ...]], None]


class Cluster:
    def __init__(
        self,
        replicas: Iterable[ReplicaState] = (),
        *,
        clock: Callable[[], float] = time.monotonic,
        stale_after: float = 2.0,
    ) -> None:
        self.clock = clock
        self.stale_after = stale_after
        self._members: dict[ReplicaId, ReplicaState] = {}
        self._healthy: dict[ReplicaId, bool] = {}
        self._loads: dict[ReplicaId, EngineLoad] = {}
        self._models: dict[ReplicaId, frozenset[str]] = {}
        self._in_flight: dict[ReplicaId, int] = {}
        self.in_flight: Mapping[ReplicaId, int] = MappingProxyType(self._in_flight)
        self._listeners: list[MembershipListener] = []
        self._view: ClusterView | None = None
        self._known_models: frozenset[str] | None = None
        self._evidence: CacheEvidence | None = None
        # Queued prefill and measured prefill speed per replica, fed by the proxy at
        # dispatch and first token; every view carries it (gateway.prefill_meter).
        self.prefill = PrefillMeter()
        # Told when a replica with nothing in flight gets a request (the scraper and the
        # health probes read a quiet replica less often and wake up for this).
        self._busy_listeners: list[Callable[[ReplicaId], None]] = []
        self.set_members(replicas)

    # -- membership ---------------------------------------------------------------------
    def on_membership_change(self, listener: MembershipListener) -> None:
        self._listeners.append(listener)

    def on_busy(self, listener: Callable[[ReplicaId], None]) -> None:
        """`listener(replica)` runs when a replica with nothing in flight gets a request."""
        self._busy_listeners.append(listener)

    def set_members(self, replicas: Iterable[ReplicaState]) -> None:
        """Replace the replica set (ids kept keep their health, load and counters)."""
        members = {r.id: r for r in replicas}
        self._members = members
        for rid in [k for k in self._healthy if k not in members]:
            self.prefill.forget(rid)
        for table in (self._healthy, self._loads, self._models):
            for rid in [k for k in table if k not in members]:
                del table[rid]
        for rid, r in members.items():
            self._healthy.setdefault(rid, r.healthy)
            self._in_flight.setdefault(rid, 0)
        # Counters of removed replicas are kept until their requests finish (see release).
        self._invalidate()
        snapshot = self.view().replicas
        for listener in self._listeners:
            listener(snapshot)

    @property
    def members(self) -> Mapping[ReplicaId, ReplicaState]:
        return self._members

    def url_of(self, replica: ReplicaId) -> str:
        return self._members[replica].url

    # -- writers ------------------------------------------------------------------------
    def set_healthy(self, replica: ReplicaId, healthy: bool) -> bool:
        """Returns True when this changed the replica's health."""
        if replica not in self._members or self._healthy.get(replica) == healthy:
            return False
        self._healthy[replica] = healthy
        self._invalidate()
        return True

    def publish_load(self, replica: ReplicaId, load: EngineLoad | None) -> None:
        """The scraper's entry point: one replica's latest engine load (None = unknown)."""
        if replica not in self._members:
            return
        if load is None:
            self._loads.pop(replica, None)
        else:
            self._loads[replica] = load
        self._invalidate()

    def set_cache_evidence(self, evidence: CacheEvidence | None) -> None:
        """Event-fed cache knowledge every later view carries (gateway.kvevents)."""
        self._evidence = evidence
        self._invalidate()

    def set_models(self, replica: ReplicaId, models: Iterable[str]) -> None:
        if replica not in self._members:
            return
        found = frozenset(models)
        if self._models.get(replica) != found:
            self._models[replica] = found
            self._invalidate()

    # -- in-flight accounting (exact: every acquire is paired with one release) ---------
    def acquire(self, replica: ReplicaId) -> None:
        before = self._in_flight.get(replica, 0)
        self._in_flight[replica] = before + 1
        if not before:
            for listener in self._busy_listeners:
                listener(replica)

    def release(self, replica: ReplicaId) -> None:
        left = self._in_flight[replica] - 1
        if left or replica in self._members:
            self._in_flight[replica] = left
        else:
            del self._in_flight[replica]

    # -- readers ------------------------------------------------------------------------
    def load_of(self, replica: ReplicaId) -> EngineLoad | None:
        """The replica's latest engine load as published (None: none yet, or unknown)."""
        return self._loads.get(replica)

    def is_healthy(self, replica: ReplicaId) -> bool:
        return self._healthy.get(replica, False)

    def view(self) -> ClusterView:
        view = self._view
        now = self.clock()
        if view is None:
            view = self._view = self._build(now)
        elif now - view.now > VIEW_MAX_AGE_S:
            # Nothing changed but the time: keep the same replicas tuple (policies cache on it).
            view = self._view = ClusterView(
                replicas=view.replicas,
                now=now,
                stale_after=self.stale_after,
                in_flight=self.in_flight,
                by_id=view.by_id,
                cache_evidence=self._evidence,
                prefill=self.prefill,
            )
        return view

    def known_models(self) -> frozenset[str] | None:
        """Every model some replica serves, or None while any replica's set is unknown."""
        self.view()
        return self._known_models

    def _invalidate(self) -> None:
        self._view = None

    def _build(self, now: float) -> ClusterView:
        states = []
        all_known = True
        models_union: set[str] = set()
        for rid, base in self._members.items():
            models = base.models or self._models.get(rid, frozenset())
            if models:
                models_union.update(models)
            else:
                all_known = False
            load = self._loads.get(rid)
            states.append(
                replace(
                    base,
                    healthy=self._healthy.get(rid, False),
                    models=models,
                    load=load,
                    kv_capacity_tokens=base.kv_capacity_tokens
                    or (load.kv_capacity_tokens if load else None),
                )
            )
        self._known_models = frozenset(models_union) if all_known and states else None
        return ClusterView(
            replicas=tuple(states),
            now=now,
            stale_after=self.stale_after,
            in_flight=self.in_flight,
            cache_evidence=self._evidence,
            prefill=self.prefill,
        )
