"""`install(state)`: the console's sampler as a lifespan service and its routes.

Listed last in `gateway.app.FEATURE_INSTALLERS`, so every feature it reads (scraper, pools,
admission, PD) is already on the state.
"""

from __future__ import annotations

from gateway.console.api import console_routes
from gateway.console.runtime import ConsoleRuntime
from gateway.state import GatewayState

EXTRAS_KEY = "console"


def install(state: GatewayState) -> None:
    settings = state.settings.console
    if not settings.enabled:
        return
    runtime = ConsoleRuntime.build(state, settings)
    state.services.append(runtime)
    state.extras[EXTRAS_KEY] = runtime
    state.routes.extend(console_routes(runtime))
