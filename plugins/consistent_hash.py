"""Session-sticky consistent hashing with bounded load.

The session key (see `gateway.keys`) is hashed onto a ring of the replicas (xxh3, virtual
nodes scaled by weight). Unhealthy replicas and replicas that do not serve the model are
skipped by walking clockwise, so a session whose replica is down lands on the next one and
returns when it recovers. A replica whose in-flight count would exceed
``load_factor x mean`` (weighted) passes the request on to the next replica.

Complexity: O(log(V·N)) for the lookup plus a walk to the first RANK_DEPTH eligible
replicas under their bound (one C-level O(N) sum of in-flight counts); the ring is rebuilt (O(V·N log(V·N))) only when the membership or weights change.

Reasons reported: ``ring`` (the key's owner), ``failover`` (the owner is unhealthy or does
not serve the model), ``bounded_load`` (the owner is over its load bound), ``sticky`` (the
session store's placement was honoured), ``no_candidates``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pydantic import Field

from gateway.policy import RANK_DEPTH, PolicyConfig, PolicyContext
from gateway.ring import DEFAULT_LOAD_FACTOR, DEFAULT_VNODES, HashRing, RingNode
from gateway.types import Choice, ClusterView, ReplicaId, ReplicaState, RouteRequest


class ConsistentHashConfig(PolicyConfig):
    vnodes: int = Field(DEFAULT_VNODES, ge=1, le=4096, description="virtual nodes per unit weight")
    load_factor: float | None = Field(
        DEFAULT_LOAD_FACTOR,
        gt=1.0,
        description="bounded-load factor over the mean in-flight count; null disables",
    )
    honor_sticky: bool = Field(
        False,
        description="rank the session store's recorded replica first when it is eligible "
        "(keeps sessions in place after membership changes; off by default so sessions "
        "return to their ring owner after it recovers)",
    )


_MAX_CACHED = 16


class ConsistentHash:
    name: ClassVar[str] = "consistent_hash"
    Config: ClassVar[type[PolicyConfig]] = ConsistentHashConfig

    def __init__(self, config: PolicyConfig, context: PolicyContext) -> None:
        assert isinstance(config, ConsistentHashConfig)
        self.config = config
        # Rings by (id, weight) member set. A routing layer may hand us views narrowed per
        # model (and without unhealthy replicas), so several member sets alternate; each
        # ring is built once. Walking a ring without r equals walking the full ring and
        # skipping r, so narrowing never changes where a key lands.
        self._rings: dict[tuple[tuple[ReplicaId, float], ...], HashRing] = {}
        # Per view.replicas tuple (held, so identity checks are safe): ring + eligible sets.
        self._views: dict[
            int, tuple[tuple[ReplicaState, ...], HashRing, dict[str, frozenset[ReplicaId]]]
        ] = {}
        self._ring = self._ring_for(context.replicas)

    def _ring_for(self, replicas: Sequence[ReplicaState]) -> HashRing:
        members = tuple(sorted((r.id, r.weight) for r in replicas))
        ring = self._rings.get(members)
        if ring is None:
            if len(self._rings) >= _MAX_CACHED:
                self._rings.pop(next(iter(self._rings)))
            ring = self._rings[members] = HashRing(
                (RingNode(i, w) for i, w in members), self.config.vnodes
            )
        return ring

    def membership_changed(self, replicas: Sequence[ReplicaState]) -> None:
        self._ring = self._ring_for(replicas)

    def choose(self, request: RouteRequest, view: ClusterView) -> Choice:
        # Views are rebuilt only on change, so an identity lookup keeps this O(1) per request.
        replicas = view.replicas
        entry = self._views.get(id(replicas))
        if entry is None or entry[0] is not replicas:
            if len(self._views) >= _MAX_CACHED:
                self._views.pop(next(iter(self._views)))
            entry = (replicas, self._ring_for(replicas), {})
            self._views[id(replicas)] = entry
        _, ring, by_model = entry
        model = request.model
        eligible = by_model.get(model)
        if eligible is None:
            weights = ring.members
            eligible = frozenset(
                r.id for r in replicas if r.healthy and r.serves(model) and weights.get(r.id, 0) > 0
            )
            by_model[model] = eligible
        # Only the head of the ranking is computed: failover never goes deeper than
        # RANK_DEPTH, and the proxy asks again when a ranking is used up.
        pick = ring.lookup(
            request.session_key,
            in_flight=view.in_flight,
            load_factor=self.config.load_factor,
            members=eligible,
            depth=RANK_DEPTH,
        )
        ranked = pick.ranked
        if not ranked:
            return Choice((), "no_candidates", self.name)
        sticky = request.sticky_replica
        if (
            self.config.honor_sticky
            and sticky is not None
            and sticky in eligible
            and sticky != ranked[0]
        ):
            if sticky in ranked:
                ranked.remove(sticky)
            ranked.insert(0, sticky)
            return Choice(tuple(ranked), "sticky", self.name)
        return Choice(tuple(ranked), pick.reason, self.name)
