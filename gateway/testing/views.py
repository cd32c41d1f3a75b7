"""Builders for `RouteRequest` and `ClusterView`, for policy unit tests (no event loop)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from types import MappingProxyType

from gateway.types import (
    ClusterView,
    EngineLoad,
    ReplicaId,
    ReplicaState,
    RouteRequest,
    SessionKey,
)


def make_request(
    session: str = "session-1",
    model: str = "m",
    **fields: object,
) -> RouteRequest:
    """A `RouteRequest` with sensible defaults; any field can be overridden."""
    values: dict[str, object] = {
        "request_id": "req-1",
        "model": model,
        "session_key": SessionKey(session),
    }
    values.update(fields)
    return RouteRequest(**values)  # type: ignore[arg-type]


class ViewBuilder:
    """Fluent builder: ``ViewBuilder().replicas(4).unhealthy("r1").inflight(r0=3).build()``."""

    def __init__(self, now: float = 1000.0) -> None:
        self._replicas: dict[ReplicaId, ReplicaState] = {}
        self._inflight: dict[ReplicaId, int] = {}
        self._now = now
        self._stale_after = 2.0

    def replicas(self, count: int, *, prefix: str = "r", **fields: object) -> ViewBuilder:
        for i in range(count):
            self.replica(f"{prefix}{i}", **fields)
        return self

    def replica(self, rid: str, **fields: object) -> ViewBuilder:
        fields.setdefault("url", f"http://{rid}.invalid:8000")
        self._replicas[ReplicaId(rid)] = ReplicaState(id=ReplicaId(rid), **fields)  # type: ignore[arg-type]
        return self

    def _update(self, rids: Iterable[str], **changes: object) -> ViewBuilder:
        for rid in rids:
            key = ReplicaId(rid)
            self._replicas[key] = replace(self._replicas[key], **changes)  # type: ignore[arg-type]
        return self

    def unhealthy(self, *rids: str) -> ViewBuilder:
        return self._update(rids, healthy=False)

    def weight(self, rid: str, weight: float) -> ViewBuilder:
        return self._update([rid], weight=weight)

    def models(self, rid: str, *models: str) -> ViewBuilder:
        return self._update([rid], models=frozenset(models))

    def load(
        self, rid: str, *, waiting: float = 0, running: float = 0, age: float = 0.0, **kw: object
    ) -> ViewBuilder:
        load = EngineLoad(waiting=waiting, running=running, scraped_at=self._now - age, **kw)  # type: ignore[arg-type]
        return self._update([rid], load=load)

    def inflight(self, counts: Mapping[str, int] | None = None, **kw: int) -> ViewBuilder:
        for rid, n in {**(counts or {}), **kw}.items():
            self._inflight[ReplicaId(rid)] = n
        return self

    def stale_after(self, seconds: float) -> ViewBuilder:
        self._stale_after = seconds
        return self

    def build(self) -> ClusterView:
        return ClusterView(
            replicas=tuple(self._replicas.values()),
            now=self._now,
            stale_after=self._stale_after,
            in_flight=MappingProxyType(dict(self._inflight)),
        )
