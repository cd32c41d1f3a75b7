"""The one typed object `build_app` hangs everything on (no globals anywhere)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.middleware import Middleware
from starlette.routing import BaseRoute

from gateway.cluster import Cluster
from gateway.errors import ConfigError
from gateway.health import HealthMonitor
from gateway.hooks import (
    AdmissionGate,
    Dispatcher,
    DispatchObserver,
    InboundRewrite,
    LocalPlacements,
    OutcomeObserver,
    PayloadShaper,
    PrefillObserver,
    PreRoute,
    RequestMeter,
    RequestTracer,
    Service,
    SessionPlacements,
    Tiers,
)
from gateway.lineage import Conversations
from gateway.metrics import GatewayMetrics
from gateway.models import ModelsCache
from gateway.policy import (
    EstimatesCachedTokens,
    ObservesOutcome,
    ObservesPlacement,
    Policy,
    TracksPrefill,
)
from gateway.settings import KvgateSettings
from gateway.types import ReplicaId, RouteRequest
from gateway.upstream import UpstreamClient
from gateway.wrappers import ROUTER_LAYERS

_P = TypeVar("_P", bound=Policy)


@dataclass(eq=False)
class GatewayState:
    settings: KvgateSettings
    cluster: Cluster
    router: Policy
    client: UpstreamClient
    metrics: GatewayMetrics
    health: HealthMonitor
    models: ModelsCache
    observers: list[OutcomeObserver] = field(default_factory=list)
    # Closes what a feature left in the scope, once per request (gateway.hooks.RequestMeter).
    meters: list[RequestMeter] = field(default_factory=list)
    dispatch_observers: list[DispatchObserver] = field(default_factory=list)
    prefill_observers: list[PrefillObserver] = field(default_factory=list)
    # Body rewrites features ask of inbound (gateway.hooks.InboundRewrite), in order.
    inbound_rewrites: list[InboundRewrite] = field(default_factory=list)
    admission: AdmissionGate | None = None
    payload: PayloadShaper | None = None
    pre_route: PreRoute | None = None
    dispatcher: Dispatcher | None = None
    tracer: RequestTracer | None = None
    placements: SessionPlacements | None = field(default_factory=LocalPlacements)
    services: list[Service] = field(default_factory=list)
    # Feature-owned objects by feature name (e.g. extras["pd"]), for their own endpoints.
    extras: dict[str, Any] = field(default_factory=dict)
    # Extra routes a feature serves (e.g. GET /admin/pools); build_app mounts them.
    routes: list[BaseRoute] = field(default_factory=list)
    # Pure ASGI middlewares a feature adds after the request id (e.g. auth); every route,
    # fast or not, runs them (gateway.fastpath).
    middleware: list[Middleware] = field(default_factory=list)
    # Public model name -> name sent upstream (aliases); None: names pass unchanged.
    resolve_model: Callable[[str], str] | None = None
    # Tiered public model names (gateway.tiers): entry tier, checks, escalation.
    tiers: Tiers | None = None
    # Router abilities, detected once (see set_router), never probed per request.
    router_placed: Callable[[RouteRequest, ReplicaId], None] | None = None
    router_finished: Callable[[RouteRequest, ReplicaId, bool, float], None] | None = None
    router_prefill: TracksPrefill | None = None
    router_cached: Callable[[RouteRequest, ReplicaId], int] | None = None
    # Conversation lineage for requests without a client session id (gateway.lineage).
    lineage: Conversations | None = None
    # Router layers applied so far (gateway.wrappers.ROUTER_LAYERS names), innermost first.
    router_layers: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.set_router(self.router)

    def wrap_router(self, layer: str, wrap: Callable[[Policy], _P]) -> _P:
        """Put layer `layer` around the router (`wrap(inner) -> router`), in the one order
        `gateway.wrappers.ROUTER_LAYERS` declares; returns the new router."""
        if layer not in ROUTER_LAYERS:
            raise ConfigError(
                f"unknown router layer {layer!r}; declared layers: {', '.join(ROUTER_LAYERS)}"
            )
        rank = ROUTER_LAYERS.index(layer)
        outer = [name for name in self.router_layers if ROUTER_LAYERS.index(name) >= rank]
        if outer:
            raise ConfigError(
                f"router layer {layer!r} must go inside {outer} (declared order, innermost "
                f"first: {', '.join(ROUTER_LAYERS)}); check the order of FEATURE_INSTALLERS"
            )
        router = wrap(self.router)
        self.router_layers.append(layer)
        self.set_router(router)
        return router

    def set_router(self, router: Policy) -> None:
        """Replace the router (e.g. a wrapper policy) and re-detect its abilities."""
        self.router = router
        self.router_placed = router.placed if isinstance(router, ObservesPlacement) else None
        self.router_finished = router.finished if isinstance(router, ObservesOutcome) else None
        self.router_prefill = router if isinstance(router, TracksPrefill) else None
        self.router_cached = (
            router.cached_tokens if isinstance(router, EstimatesCachedTokens) else None
        )
