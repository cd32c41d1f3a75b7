"""`install(state)`: wires tiered models into a gateway built by `build_app`.

Does nothing unless the `tiers:` section is present. Otherwise: `state.tiers` (the
inbound stage asks it for a tiered request's entry tier, gateway.proxy.tiered for checks
and escalation) and the tier metrics on the gateway's registry.
"""

from __future__ import annotations

from gateway.state import GatewayState
from gateway.tiers.metrics import TierCollector
from gateway.tiers.runtime import TiersRuntime

EXTRAS_KEY = "tiers"


def install(state: GatewayState) -> None:
    settings = state.settings.tiers
    if settings is None:
        return
    runtime = TiersRuntime(settings, state.cluster.view, state.resolve_model)
    state.tiers = runtime
    state.extras[EXTRAS_KEY] = runtime
    state.metrics.registry.register(TierCollector(runtime.ledger))
