"""The gateway's own answers on the proxy path: an error in the route's API shape, sent once."""

from __future__ import annotations

import time

from gateway.errors import GatewayError, error_response_parts
from gateway.metrics import GatewayMetrics
from gateway.proxy.exchange import Exchange
from gateway.scope import HEAD_HOLDER_KEY


async def send_error(ex: Exchange, err: GatewayError, metrics: GatewayMetrics) -> None:
    status, headers, body = error_response_parts(err, ex.errors)
    metrics.error(err.code or "error")
    call = ex.call
    call.stop_watching()
    call.ttfb = time.perf_counter()
    call.started = True
    if (holder := ex.scope.get(HEAD_HOLDER_KEY)) is not None:
        holder.hold()
    await ex.send({"type": "http.response.start", "status": status, "headers": headers})
    await ex.send({"type": "http.response.body", "body": body, "more_body": False})
