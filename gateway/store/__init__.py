"""Shared routing state behind the `Store` protocol (memory by default, Redis optional)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from gateway.store.base import Ejection, PrefixPlacement, Store, StoreStatus
from gateway.store.config import StoreSettings
from gateway.store.memory import MemoryStore

__all__ = [
    "Ejection",
    "MemoryStore",
    "PrefixPlacement",
    "Store",
    "StoreSettings",
    "StoreStatus",
    "build_store",
]


def build_store(settings: StoreSettings, *, registry: CollectorRegistry | None = None) -> Store:
    """The configured store. Nothing connects until `start()` (called in the lifespan)."""
    if settings.backend == "redis":
        # Imported here so the embedded default never loads the Redis client.
        from gateway.store.redis import RedisStore

        return RedisStore(settings, registry=registry)
    return MemoryStore(settings)
