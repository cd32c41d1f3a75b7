"""Hand-built pools, replicas and views for the pools tests."""

from __future__ import annotations

from typing import Any

from gateway.policy import Policy, PolicyContext
from gateway.pools.config import PoolsSettings
from gateway.types import ClusterView, EngineLoad, ReplicaId, ReplicaState, RouteRequest
from plugins.consistent_hash import ConsistentHash, ConsistentHashConfig

MODEL = "glm-4.6"
FP4_MODEL = "deepseek-v4-fp4"


def settings(**overrides: Any) -> PoolsSettings:
    """Two pools: a fast, pricey imported pool with fp4, and a cheap domestic pool without."""
    raw: dict[str, Any] = {
        "pools": [
            {
                "name": "h200",
                "hardware": "H200",
                "origin": "imported",
                "price_per_card_hour": 4.0,
                "cards_per_replica": 2,
                "capabilities": ["fp8", "fp4"],
                "max_context": 131072,
                "slots_per_replica": 10,
            },
            {
                "name": "domestic",
                "hardware": "910C",
                "origin": "domestic",
                "price_per_card_hour": 1.0,
                "cards_per_replica": 2,
                "capabilities": ["fp8"],
                "max_context": 65536,
                "slots_per_replica": 10,
            },
        ],
        "models": [
            {"name": MODEL, "aliases": ["glm", "default"]},
            {"name": FP4_MODEL, "aliases": ["deepseek"], "requires": ["fp4"]},
        ],
    }
    raw.update(overrides)
    return PoolsSettings.model_validate(raw)


def replica(
    rid: str,
    pool: str | None,
    *,
    healthy: bool = True,
    models: tuple[str, ...] = (MODEL, FP4_MODEL),
    running: float = 0.0,
    waiting: float = 0.0,
    kv: float | None = None,
) -> ReplicaState:
    return ReplicaState(
        id=ReplicaId(rid),
        url=f"http://{rid}.invalid",
        healthy=healthy,
        models=frozenset(models),
        pool=pool,
        load=EngineLoad(waiting=waiting, running=running, kv_usage=kv, scraped_at=100.0),
    )


def cluster(*replicas: ReplicaState, in_flight: dict[str, int] | None = None) -> ClusterView:
    counts = {ReplicaId(k): v for k, v in (in_flight or {}).items()}
    return ClusterView(replicas=tuple(replicas), now=100.5, in_flight=counts)


def two_pools(**load: dict[str, float]) -> ClusterView:
    """Three replicas per pool; `load` maps a replica id to replica() load keywords."""
    reps = [
        replica(f"{pool}-{i}", pool, **load.get(f"{pool}-{i}", {}))  # type: ignore[arg-type]
        for pool in ("h200", "domestic")
        for i in range(3)
    ]
    return cluster(*reps)


def request(session: str = "s-1", model: str = MODEL, **kw: Any) -> RouteRequest:
    from gateway.types import SessionKey

    return RouteRequest(
        request_id=f"r-{session}", model=model, session_key=SessionKey(session), **kw
    )


def ring_factory(replicas: tuple[ReplicaState, ...]) -> Policy:
    return ConsistentHash(ConsistentHashConfig(), PolicyContext(replicas=replicas))
