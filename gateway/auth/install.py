"""Wires API keys and quotas into a gateway (listed in `gateway.app.FEATURE_INSTALLERS`).

Nothing is installed while no key is configured: the embedded demo stays open and the
request path pays nothing. Otherwise the auth and rate-limit middlewares join the chain
every route runs (gateway.fastpath), after the request id.
"""

from __future__ import annotations

import time

from starlette.middleware import Middleware

from gateway.auth.host_counters import HostCounters
from gateway.auth.limiter import Limiter, LocalLimiter
from gateway.auth.meter import AuthMeter
from gateway.auth.metrics import AuthMetrics
from gateway.auth.middleware import AuthMiddleware
from gateway.auth.principal import KeyRing
from gateway.auth.rate_limit import RateLimitMiddleware
from gateway.auth.redis_limiter import RedisLimiter
from gateway.auth.sources import RedisKeys, static_keys
from gateway.console.api import console_asset_paths
from gateway.state import GatewayState
from gateway.store.redis import RedisStore
from gateway.workers.directory import shared_directory


def install(state: GatewayState) -> None:
    settings = state.settings.auth
    if not settings.enabled:
        return
    classes = [c.name for c in state.settings.admission.classes]
    ring = KeyRing(static_keys(settings), settings.tenants, classes)
    store = state.extras.get("store")
    limiter: Limiter
    if isinstance(store, RedisStore):
        shared = RedisLimiter(store, settings.quota_timeout_s)
        state.services.append(shared)
        limiter = shared
        if settings.redis_keys:
            state.services.append(RedisKeys(store, ring, settings.redis_refresh_s))
    else:
        # `--workers N` without Redis: the workers count in one file (gateway.auth.host_counters).
        shared_dir = shared_directory()
        counters = HostCounters(shared_dir, time.time) if shared_dir is not None else None
        limiter = LocalLimiter(counters)
    metrics = AuthMetrics(state.metrics.registry)
    metrics_need_admin = settings.metrics_need_admin

    def needs_admin(path: str) -> bool:
        return path.startswith("/admin") or (metrics_need_admin and path == "/metrics")

    console = state.settings.console
    public = console_asset_paths(console.path) if console.enabled else frozenset()
    state.middleware += [
        Middleware(
            AuthMiddleware, ring=ring, needs_admin=needs_admin, metrics=metrics, public=public
        ),
        Middleware(RateLimitMiddleware, limiter=limiter, metrics=metrics),
    ]
    # The key's usage series and its ticket's settlement, at each request's end.
    state.meters.append(AuthMeter(metrics))
