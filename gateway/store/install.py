"""Wires the shared store into a gateway app (listed in `gateway.app.FEATURE_INSTALLERS`).

With `store.backend: memory` (the default) the core's in-process placements stay as they
are and the store is only there for the features that read it (`state.extras["store"]`). With
`redis` the store becomes the session-placement seam, its sticky replica is honoured by
`StickyFirst`, ejections are shared both ways with the health monitor, membership removals
forget sessions, and prefix placements of other instances feed the router's index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable

from gateway.health import Health
from gateway.state import GatewayState
from gateway.store import Store, build_store
from gateway.store.sticky import StickyFirst
from gateway.types import ReplicaId, ReplicaState, SessionKey

log = logging.getLogger("kvgate.store")


class StorePlacements:
    """The proxy's `SessionPlacements` seam, backed by a `Store`."""

    def __init__(self, store: Store) -> None:
        self._store = store

    async def lookup(self, key: SessionKey) -> ReplicaId | None:
        return await self._store.lookup_session(key)

    async def record(self, key: SessionKey, replica: ReplicaId) -> None:
        await self._store.assign_session(key, replica)

    async def link_response(self, response: str, root: str) -> None:
        await self._store.link_response(response, root)

    async def response_root(self, response: str) -> str | None:
        return await self._store.response_root(response)

    async def share(self) -> None:
        await self._store.flushed()


class StoreService:
    """Starts the store, mirrors shared ejections into the cluster, stops it last."""

    def __init__(
        self, state: GatewayState, store: Store, interval_s: float, *, mirror: bool
    ) -> None:
        self.state = state
        self.mirror = mirror
        self.store = store
        self.interval_s = interval_s
        self._forced: set[ReplicaId] = set()
        self._task: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[None]] = set()
        self._members = frozenset(state.cluster.members)

    async def start(self) -> None:
        await self.store.start()
        if not self.mirror:
            return
        self._task = asyncio.create_task(self._mirror_ejections(), name="kvgate-store-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._pending:
            await asyncio.wait(self._pending, timeout=1.0)
        await self.store.close()

    def spawn(self, work: Awaitable[None]) -> None:
        """Run a store verb from a synchronous callback (they only queue, never wait)."""
        try:
            task = asyncio.get_running_loop().create_task(_run(work))
        except RuntimeError:
            if asyncio.iscoroutine(work):
                work.close()
            return
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def health_changed(self, replica: ReplicaId, health: Health) -> None:
        # An outlier's ejection lasts longer than the probes' cooldown: share its own length.
        cooldown = self.state.health.ejected_for(replica) or self.state.settings.health.cooldown_s
        if health is Health.EJECTED:
            self.spawn(self.store.eject_replica(replica, cooldown, "health"))
        elif health is Health.HEALTHY:
            self.spawn(self.store.readmit_replica(replica))

    def membership_changed(self, replicas: tuple[ReplicaState, ...]) -> None:
        members = frozenset(r.id for r in replicas)
        for gone in self._members - members:
            self.spawn(self.store.forget_replica(gone))
        self._members = members

    def apply_ejections(self) -> None:
        cluster, health = self.state.cluster, self.state.health
        ejected = self.store.ejections()
        for replica in ejected:
            if replica in cluster.members and cluster.set_healthy(replica, False):
                self._forced.add(replica)
        for replica in [r for r in self._forced if r not in ejected]:
            self._forced.discard(replica)
            cluster.set_healthy(replica, health.state(replica) is not Health.EJECTED)

    async def _mirror_ejections(self) -> None:
        while True:
            self.apply_ejections()
            await asyncio.sleep(self.interval_s)


async def _run(work: Awaitable[None]) -> None:
    await work


def install(state: GatewayState) -> None:
    settings = state.settings.store
    store = build_store(settings, registry=state.metrics.registry)
    state.extras["store"] = store
    shared = settings.backend == "redis"
    service = StoreService(state, store, settings.sync_interval_s, mirror=shared)
    state.services.append(service)
    if not shared:
        return
    router = state.wrap_router(
        "sticky",
        lambda inner: StickyFirst(
            inner,
            store,
            load_factor=settings.sticky_load_factor,
            saturation=state.settings.routing.saturation,
        ),
    )
    state.placements = StorePlacements(store)
    store.subscribe_prefixes(router.place_remote)
    previous = state.health.on_change

    def on_change(replica: ReplicaId, health: Health) -> None:
        if previous is not None:
            previous(replica, health)
        service.health_changed(replica, health)

    state.health.on_change = on_change
    state.cluster.on_membership_change(service.membership_changed)
