"""The fleet as the console shows it: one row per replica, read from the live objects.

Also hooks the timeline: health transitions (the health monitor's `on_change`), membership
changes, and pool-weight changes (noticed by `pool_weights`, which the sampler calls).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.console.events import EventLog
from gateway.health import Health
from gateway.ring import DEFAULT_VNODES, HashRing, RingNode
from gateway.scrape.config import EngineKind
from gateway.state import GatewayState
from gateway.types import ReplicaId, ReplicaState


class Fleet:
    def __init__(self, state: GatewayState, events: EventLog) -> None:
        self.cluster = state.cluster
        self.registry = state.metrics.registry
        self._state = state
        self.events = events
        self._ring_key: tuple[tuple[str, float], ...] | None = None
        self._shares: dict[ReplicaId, float] = {}
        self._weights_version: int | None = None
        self._members = set(state.cluster.members)
        previous = state.health.on_change

        def health_changed(replica: ReplicaId, health: Health) -> None:
            if previous is not None:
                previous(replica, health)
            events.add(health.value, replica)

        state.health.on_change = health_changed
        state.cluster.on_membership_change(self._membership_changed)

    def _membership_changed(self, replicas: Sequence[ReplicaState]) -> None:
        now = {r.id for r in replicas}
        for rid in sorted(now - self._members):
            self.events.add("added", rid)
        for rid in sorted(self._members - now):
            self.events.add("removed", rid)
        self._members = now

    # -- per replica ------------------------------------------------------------------
    def engine_kind(self, replica: ReplicaId) -> str:
        scraper = self._state.extras.get("scrape")
        if scraper is None:
            return "unknown"
        configured: EngineKind = scraper.settings.engine_for(replica)
        if configured is not EngineKind.AUTO:
            return str(configured.value)
        detected: EngineKind | None = scraper.kinds.get(replica)
        return str(detected.value) if detected is not None else "unknown"

    def ring_shares(self, replicas: Sequence[ReplicaState]) -> Mapping[ReplicaId, float]:
        """Each healthy replica's share of the hash ring (the key space a ring policy
        spreads new sessions over); rebuilt only when health or weights change."""
        key = tuple((r.id, r.weight) for r in replicas if r.healthy)
        if key != self._ring_key:
            ring = HashRing((RingNode(ReplicaId(rid), w) for rid, w in key), DEFAULT_VNODES)
            self._shares = ring.shares()
            self._ring_key = key
        return self._shares

    def rows(self) -> list[dict[str, Any]]:
        view = self.cluster.view()
        health = self._state.health
        shares = self.ring_shares(view.replicas)
        rows = []
        for r in view.replicas:
            load = r.load
            fresh = view.load_of(r)
            rows.append(
                {
                    "id": r.id,
                    "health": health.state(r.id).value if r.healthy else Health.EJECTED.value,
                    "healthy": r.healthy,
                    "engine": self.engine_kind(r.id),
                    "pool": r.pool,
                    "role": r.role.value,
                    "weight": r.weight,
                    "in_flight": view.inflight(r.id),
                    "waiting": load.waiting if load else None,
                    "running": load.running if load else None,
                    "kv_usage": load.kv_usage if load else None,
                    "prefix_hit_rate": load.prefix_hit_rate if load else None,
                    "kv_capacity_tokens": r.kv_capacity_tokens,
                    "load_age_s": round(view.now - load.scraped_at, 3) if load else None,
                    "load_stale": load is not None and fresh is None,
                    "ring_share": shares.get(r.id, 0.0),
                }
            )
        return rows

    # -- pools ------------------------------------------------------------------------
    def pool_weights(self) -> dict[str, float] | None:
        runtime = self._state.extras.get("pools")
        if runtime is None:
            return None
        snap = runtime.controller.snapshot
        if self._weights_version is not None and snap.version != self._weights_version:
            detail = ", ".join(f"{p} {w:.2f}" for p, w in sorted(snap.weights.items()))
            self.events.add("weights", snap.code, f"{snap.reason} ({detail})")
        self._weights_version = snap.version
        return dict(snap.weights)
