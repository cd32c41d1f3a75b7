"""Wire OpenTelemetry spans in when `tracing.enabled` (propagation alone needs nothing)."""

from __future__ import annotations

from gateway.errors import ConfigError
from gateway.state import GatewayState


def install(state: GatewayState) -> None:
    settings = state.settings.tracing
    if not settings.enabled:
        return
    try:
        from gateway.tracing.spans import Tracing
    except ImportError as exc:
        raise ConfigError(
            f"tracing.enabled needs OpenTelemetry: pip install 'kvgate[otel]' ({exc})"
        ) from exc
    tracing = Tracing(settings)
    state.tracer = tracing
    state.extras["tracing"] = tracing
    state.services.append(tracing)
