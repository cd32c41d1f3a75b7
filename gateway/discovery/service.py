"""`DnsDiscovery`: a lifespan service that keeps the cluster's members in step with DNS.

Each round resolves every target, then hands the cluster one new member list: the replicas
that did not come from DNS (the YAML `replicas:`) plus the ones found. Replicas are named
by what DNS says (`target:port` for SRV, `address:port` for A), so a replica that stays
keeps its id and the ring moves only the keys of the replicas that came or went (the
ring's 1/N property). Additions join at once; a replica leaves after `remove_after`
rounds without it. A target whose lookup fails keeps its last answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.cluster import Cluster
from gateway.discovery.config import DiscoverySettings, DnsTarget
from gateway.discovery.resolve import DiscoveryError, Endpoint, url_host
from gateway.types import ReplicaId, ReplicaState

log = logging.getLogger("kvgate.discovery")


class Resolver(Protocol):
    async def lookup(self, target: DnsTarget) -> list[Endpoint]: ...


class DiscoveryMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.replicas = Gauge(
            "kvgate_discovery_replicas",
            "Replicas the last answer for each DNS target named",
            ["target"],
            multiprocess_mode="livemax",
            registry=registry,
        )
        self.lookups = Counter(
            "kvgate_discovery_lookups",
            "DNS resolutions per target and result (ok, empty, error)",
            ["target", "result"],
            registry=registry,
        )
        self.changes = Counter(
            "kvgate_discovery_membership_changes",
            "Member lists changed by DNS discovery",
            registry=registry,
        )


def replica_for(target: DnsTarget, endpoint: Endpoint) -> ReplicaState:
    return ReplicaState(
        id=ReplicaId(f"{endpoint.host}:{endpoint.port}"),
        url=f"{target.scheme}://{url_host(endpoint.address)}:{endpoint.port}",
        weight=target.weight,
        models=frozenset(target.models),
        pool=target.pool,
        role=target.role,
        price_per_hour=target.price_per_hour,
    )


class DnsDiscovery:
    def __init__(
        self,
        cluster: Cluster,
        settings: DiscoverySettings,
        resolver: Resolver,
        metrics: DiscoveryMetrics | None = None,
        *,
        on_change: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self.cluster = cluster
        self.settings = settings
        self.resolver = resolver
        self.metrics = metrics
        self.on_change = on_change
        self._last: list[dict[ReplicaId, ReplicaState]] = [{} for _ in settings.dns]
        self._current: dict[ReplicaId, ReplicaState] = {}
        self._misses: dict[ReplicaId, int] = {}
        self._task: asyncio.Task[None] | None = None

    @property
    def discovered(self) -> Sequence[ReplicaState]:
        return tuple(self._current.values())

    async def _resolve_target(self, index: int, target: DnsTarget) -> dict[ReplicaId, ReplicaState]:
        try:
            endpoints = await self.resolver.lookup(target)
        except DiscoveryError as exc:
            log.warning("discovery: %s (keeping its %d replica(s))", exc, len(self._last[index]))
            self._count(target, "error")
            return self._last[index]
        found = {r.id: r for r in (replica_for(target, e) for e in endpoints)}
        self._last[index] = found
        self._count(target, "ok" if found else "empty")
        if self.metrics is not None:
            self.metrics.replicas.labels(target.name).set(len(found))
        return found

    def _count(self, target: DnsTarget, result: str) -> None:
        if self.metrics is not None:
            self.metrics.lookups.labels(target.name, result).inc()

    async def resolve_once(self) -> bool:
        """One round; returns True when it changed the cluster's members."""
        answers = await asyncio.gather(
            *(self._resolve_target(i, t) for i, t in enumerate(self.settings.dns))
        )
        found: dict[ReplicaId, ReplicaState] = {}
        for answer in answers:
            for rid, replica in answer.items():
                found.setdefault(rid, replica)  # the first target naming an id wins
        misses: dict[ReplicaId, int] = {}
        for rid, replica in self._current.items():
            if (
                rid not in found
                and (n := self._misses.get(rid, 0) + 1) < self.settings.remove_after
            ):
                misses[rid] = n
                found[rid] = replica
        self._misses = misses
        return self._apply(found)

    def _apply(self, found: dict[ReplicaId, ReplicaState]) -> bool:
        members = self.cluster.members
        static = [r for rid, r in members.items() if rid not in self._current]
        static_ids = {r.id for r in static}
        # A configured replica of the same id wins over the DNS one.
        found = {rid: r for rid, r in found.items() if rid not in static_ids}
        if found == self._current:
            return False
        before, after = set(self._current), set(found)
        self._current = found
        self.cluster.set_members([*static, *(found[rid] for rid in sorted(found))])
        if self.metrics is not None:
            self.metrics.changes.inc()
        log.warning(
            "discovery: %d replica(s) from DNS now (added %s, removed %s)",
            len(found),
            sorted(after - before) or "none",
            sorted(before - after) or "none",
        )
        return True

    async def _round(self) -> None:
        if await self.resolve_once() and self.on_change is not None:
            await self.on_change()

    async def start(self) -> None:
        """Resolve once before the gateway takes traffic, then every `interval_s`."""
        try:
            await self._round()
        except Exception:  # a bad first round must not stop the gateway; the loop retries
            log.exception("discovery: first resolution failed")
        self._task = asyncio.create_task(self._run(), name="kvgate-discovery")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            try:
                await self._round()
            except Exception:  # the loop must outlive any one bad round
                log.exception("discovery round failed")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
