"""Hooks the opt-in trace capture into a gateway being built (see gateway.app)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.trace.capture import load_salt
from gateway.trace.config import TraceCaptureSettings
from gateway.trace.live import GatewayCapture

if TYPE_CHECKING:
    from gateway.state import GatewayState

FEATURE = "trace_capture"


def install(state: GatewayState) -> None:
    settings: TraceCaptureSettings | None = getattr(state.settings, FEATURE, None)
    if settings is None or not settings.enabled:
        return
    capture = GatewayCapture(settings, load_salt(settings.salt_file))
    state.observers.append(capture.observe)
    state.services.append(capture)
    state.extras[FEATURE] = capture
