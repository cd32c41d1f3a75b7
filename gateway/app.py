"""`build_app(settings) -> Starlette`: creates every component on one `GatewayState`.

Nothing is created at import time. Background work (embedded simulated engines when no
replica is configured, model discovery, health probes, feature services) starts in the
lifespan and stops in reverse order. Feature packages wire themselves in through
`FEATURE_INSTALLERS`: each names an `install(state) -> None` by import string and the
installers it requires, run in order (checked) at the end of `build_app`; an installer
may set the hooks described in `gateway.hooks`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway.cluster import Cluster
from gateway.errors import (
    GatewayError,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    error_response_parts,
)
from gateway.fastpath import GatewayApp
from gateway.health import HealthMonitor
from gateway.installers import Installer, run_installers
from gateway.lineage import Conversations
from gateway.metrics import CONTENT_TYPE, GatewayMetrics
from gateway.models import ModelsCache
from gateway.policy import PolicyContext, ReactsToMembership
from gateway.proxy import ProxyEndpoint
from gateway.proxy.stored import STORED_ROUTES, StoredResponseEndpoint
from gateway.request_id import RequestIdMiddleware
from gateway.routing import build_router
from gateway.settings import KvgateSettings, ReplicaSettings
from gateway.state import GatewayState
from gateway.types import ENDPOINT_PATHS, EXTRA_PATHS, ReplicaId, ReplicaState
from gateway.upstream import Timeouts, make_client

log = logging.getLogger("kvgate")

# The feature installers, run in this order by build_app, which checks that each comes
# after every installer it `requires` (gateway.installers). Feature helpers add their line
# here (the module must exist and import cleanly).
FEATURE_INSTALLERS: tuple[Installer, ...] = (
    # Pools first: one composed router per pool behind the pool selector, which the
    # store's sticky wrapper then sits around (it only reorders the pool-safe ranking).
    Installer("pools", "gateway.pools.install:install"),
    # A tier's model may be a pools alias (state.resolve_model).
    Installer("tiers", "gateway.tiers.install:install", requires=("pools",)),
    # Its sticky layer goes around the pools' router (ROUTER_LAYERS).
    Installer("store", "gateway.store.install:install", requires=("pools",)),
    # Shared keys and quotas use the store's Redis.
    Installer("auth", "gateway.auth.install:install", requires=("store",)),
    # PD's colocated layer is the outermost router layer.
    Installer("pd", "gateway.pd.install:install", requires=("pools", "store")),
    Installer("trace", "gateway.trace.install:install"),
    Installer("tracing", "gateway.tracing.install:install"),
    Installer("scrape", "gateway.scrape.install:install"),
    # The engine's own description fills in a capacity its metrics leave out.
    Installer("facts", "gateway.facts.install:install", requires=("scrape",)),
    # Endpoint discovery follows the facts' endpoints.
    Installer("kvevents", "gateway.kvevents.install:install", requires=("facts",)),
    # Its wait goes before the KV events' tokenization wait (it wraps their pre-route hook).
    Installer("same_prompt", "gateway.same_prompt:install", requires=("kvevents",)),
    # It detects the final router's abilities (e.g. a prefix index) once, after every
    # router layer; the priority direction comes from the facts, else the scraper.
    Installer(
        "admission",
        "gateway.admission.install:install",
        requires=("pools", "store", "pd", "scrape", "facts"),
    ),
    Installer("accounting", "gateway.accounting:install"),
    Installer("looplag", "gateway.looplag:install"),
    # Reads what the others installed (scraper, pools, admission); adds no request-path hook.
    Installer(
        "console", "gateway.console.install:install", requires=("scrape", "pools", "admission")
    ),
    # With --workers N: /metrics merges every worker's series (gateway.workers).
    Installer("workers", "gateway.workers.install:install"),
    # Its service starts after every other service (they listen to membership changes).
    Installer(
        "discovery",
        "gateway.discovery.install:install",
        requires=(
            "pools",
            "store",
            "auth",
            "trace",
            "tracing",
            "scrape",
            "kvevents",
            "admission",
            "looplag",
            "console",
            "workers",
        ),
    ),
)

_UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")

ROUTES = (
    *((path, endpoint) for endpoint, path in ENDPOINT_PATHS.items()),
    *EXTRA_PATHS.items(),
)


def replica_state(r: ReplicaSettings) -> ReplicaState:
    return ReplicaState(
        id=ReplicaId(r.id),
        url=r.url,
        weight=r.weight,
        models=frozenset(r.models),
        pool=r.pool,
        role=r.role,
        price_per_hour=r.price_per_hour,
    )


def _error_response(err: GatewayError) -> Response:
    status, headers, body = error_response_parts(err)
    return Response(body, status_code=status, headers={k.decode(): v.decode() for k, v in headers})


def build_state(settings: KvgateSettings) -> GatewayState:
    replicas = tuple(replica_state(r) for r in settings.replicas)
    cluster = Cluster(replicas)
    t = settings.timeouts
    timeouts = Timeouts(t.connect_s, t.response_headers_s, t.read_s)
    upstream, cap = settings.upstream, settings.limits.max_response_bytes
    client = make_client(upstream.client, timeouts, upstream.max_connections, cap)
    router = build_router(settings.routing, PolicyContext(replicas=replicas))
    if isinstance(router, ReactsToMembership):
        cluster.on_membership_change(router.membership_changed)
    metrics = GatewayMetrics(cluster)
    session = settings.session
    lineage = None
    if session.lineage and session.max_prefix_blocks:
        lineage = Conversations(
            session.block_tokens,
            session.lineage_capacity_factor,
            session.lineage_max_blocks,
            session.max_lineages,
            session.lineage_slack_tokens,
        )
        metrics.watch_lineage(lineage.index)
    auth = settings.upstream.auth_headers()
    # Probes get a pool of their own: behind busy proxied connections they would time out
    # and eject a replica that is only busy. Same kind and cap (a cap, not a reservation).
    probe_client = make_client(upstream.client, timeouts, upstream.max_connections, cap)
    health = HealthMonitor(cluster, probe_client, settings.health, headers=auth)
    metrics.watch_health(health)
    models = ModelsCache(cluster, client, settings.models.cache_ttl_s, t.probe_s, headers=auth)
    return GatewayState(
        settings=settings,
        cluster=cluster,
        router=router,
        client=client,
        metrics=metrics,
        health=health,
        models=models,
        lineage=lineage,
    )


async def _start_embedded_sim(state: GatewayState) -> Any:
    """Start simulated engines and make them the cluster (only when no replica is set)."""
    from gateway.sim.cluster import SimCluster

    sim = state.settings.sim
    cluster = SimCluster(
        replicas=sim.replicas, profile=sim.profile, time_scale=sim.time_scale, model=sim.model
    )
    # Each embedded server's uvicorn.Config sets the process-wide uvicorn log levels to its
    # own quiet "warning"; put them back, or the gateway's own server never says where it
    # listens.
    levels = {name: logging.getLogger(name).level for name in _UVICORN_LOGGERS}
    try:
        await cluster.start()
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    state.cluster.set_members(
        ReplicaState(id=ReplicaId(f"sim-{i}"), url=url, models=frozenset({sim.model}))
        for i, url in enumerate(cluster.urls)
    )
    return cluster


def _lifespan(
    state: GatewayState,
) -> Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        settings = state.settings
        sim = None
        tasks: list[asyncio.Task[None]] = []
        started: list[Any] = []
        try:
            if not settings.has_replicas and not state.cluster.members:
                sim = await _start_embedded_sim(state)
                state.extras["sim"] = sim
            if settings.models.discover and state.cluster.members:
                await state.models.refresh()
            tasks.append(asyncio.create_task(state.health.run(), name="kvgate-health"))
            if settings.models.discover:
                tasks.append(
                    asyncio.create_task(
                        state.models.run(settings.models.refresh_s), name="kvgate-models"
                    )
                )
            for service in state.services:
                await service.start()
                started.append(service)
            yield
        finally:
            for service in reversed(started):
                try:
                    await service.stop()
                except Exception:
                    log.exception("stopping %r failed", service)
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await state.client.aclose()
            await state.health.client.aclose()
            if sim is not None:
                await sim.stop()

    return lifespan


def build_app(settings: KvgateSettings | None = None) -> Starlette:
    """A fresh gateway app; everything it uses hangs on `app.state.gateway`."""
    settings = settings or KvgateSettings()
    state = build_state(settings)
    run_installers(state, FEATURE_INSTALLERS)

    async def health(request: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    lifecycle = Lifecycle()

    async def ready(request: Request) -> Response:
        healthy = [r for r in state.cluster.members if state.cluster.is_healthy(r)]
        ok = bool(healthy) and not lifecycle.draining
        body = orjson.dumps(
            {"ready": ok, "healthy_replicas": len(healthy), "draining": lifecycle.draining}
        )
        return Response(body, status_code=200 if ok else 503, media_type="application/json")

    async def metrics(request: Request) -> Response:
        return Response(await state.metrics.exposition(), media_type=CONTENT_TYPE)

    async def models(request: Request) -> Response:
        return Response(await state.models.body(), media_type="application/json")

    async def model(request: Request) -> Response:
        # The SDKs' `models.retrieve`: one card of the merged list, or OpenAI's 404.
        card = await state.models.card(request.path_params["model_id"])
        if card is None:
            name = request.path_params["model_id"]
            return _error_response(
                ModelNotFound(f"The model `{name}` does not exist.", param="model")
            )
        return Response(card, media_type="application/json")

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            return _error_response(
                MethodNotAllowed(f"method {request.method} is not allowed on {request.url.path}")
            )
        return _error_response(NotFound(f"no route for {request.method} {request.url.path}"))

    proxies = {path: ProxyEndpoint(state, endpoint, path) for path, endpoint in ROUTES}
    routes: list[BaseRoute] = [
        Route(path, proxy, methods=["POST"]) for path, proxy in proxies.items()
    ]
    routes += [
        Route(r.path, StoredResponseEndpoint(state, r), methods=[r.method]) for r in STORED_ROUTES
    ]
    routes += [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    routes += state.routes
    app = GatewayApp(
        fast_posts=proxies,
        routes=routes,
        middleware=[Middleware(RequestIdMiddleware), *state.middleware],
        exception_handlers={HTTPException: http_error},
        lifespan=_lifespan(state),
    )
    app.state.gateway = state
    app.state.lifecycle = lifecycle
    return app


@dataclass(slots=True)
class Lifecycle:
    """Process-level state the readiness probe reports (set by `kvgate serve`'s signals)."""

    draining: bool = False


async def reload_replicas(state: GatewayState, settings: KvgateSettings) -> bool:
    """Make `settings.replicas` the cluster (SIGHUP). Returns False when nothing changed.

    Replicas that stay keep their health, load and counters; requests in flight to a removed
    one finish there (gateway.cluster). Only the replica list (urls, weights, roles, pools,
    models) is reloaded; every other setting needs a restart.
    """
    if not settings.replicas:
        log.warning(
            "reload: the file lists no replicas; keeping the current %d", len(state.cluster.members)
        )
        return False
    replicas = tuple(replica_state(r) for r in settings.replicas)
    if replicas == tuple(state.cluster.members.values()):
        log.info("reload: replica list unchanged")
        return False
    before = set(state.cluster.members)
    state.cluster.set_members(replicas)
    after = set(state.cluster.members)
    log.warning(
        "reload: %d replica(s) now (added %s, removed %s)",
        len(after),
        sorted(after - before) or "none",
        sorted(before - after) or "none",
    )
    if state.settings.models.discover:
        await state.models.refresh()
    return True


def app_from_env() -> Starlette:
    """Factory for multi-worker `kvgate serve`: settings file named by KVGATE_CONFIG_FILE."""
    import os

    from gateway.collector import tune_collector
    from gateway.settings import CONFIG_FILE_ENV, load_settings

    app = build_app(load_settings(os.environ.get(CONFIG_FILE_ENV) or None))
    tune_collector()  # each worker is a `kvgate serve` process of its own
    return app
