"""`install(state)`: wires the pools feature into a gateway built by `build_app`.

Does nothing unless the `pools:` section is present. Otherwise: one router instance per
pool behind a `PoolSelector`, alias resolution before the proxy's model check, the cost
observer (and the prefix warmer, with `warm_moves`), the weight controller as a lifespan
service, and GET /admin/pools.
"""

from __future__ import annotations

from gateway.policy import Policy, PolicyContext
from gateway.pools.admin import admin_route
from gateway.pools.runtime import PoolsRuntime
from gateway.pools.warm import PrefixWarmer
from gateway.routing import build_router
from gateway.state import GatewayState
from gateway.types import ReplicaState

EXTRAS_KEY = "pools"


def install(state: GatewayState) -> None:
    settings = state.settings.pools
    if settings is None:
        return
    replicas = tuple(state.cluster.members.values())
    runtime = PoolsRuntime(settings, replicas, state.cluster.view, registry=state.metrics.registry)
    routing = state.settings.routing

    def per_pool_router(members: tuple[ReplicaState, ...]) -> Policy:
        return build_router(routing, PolicyContext(replicas=members))

    selector = runtime.wrap(per_pool_router, replicas)
    state.cluster.on_membership_change(runtime.membership_changed)
    state.wrap_router("pools", lambda _configured: selector)
    if settings.warm_moves.enabled:
        runtime.warmer = PrefixWarmer(settings.warm_moves, selector, state, runtime.charge_warmup)
    state.observers.append(runtime.observe)
    state.services.append(runtime)
    state.extras[EXTRAS_KEY] = runtime
    state.resolve_model = runtime.served_model
    state.routes.append(admin_route(lambda: runtime))
