"""Bodies the gateway does not read (audio, text transcripts: neither JSON nor SSE), relayed
as they arrive: one engine chunk in flight at a time, whatever the body's size.

The engine's Content-Length goes along when it sent one (the client then knows the size);
otherwise the body is chunked. A failure before the first byte is still a clean error in
OpenAI's shape. After it nothing can be told in the body (an error JSON inside audio
would be taken for audio), so the response is left incomplete: the ASGI server closes the
connection, and the client sees the body end short (fewer bytes than declared, or no last
chunk) instead of a truncated body that looks whole.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gateway.errors import GatewayError
from gateway.forward import Leg
from gateway.metrics import GatewayMetrics
from gateway.proxy.exchange import Exchange
from gateway.proxy.respond import send_error
from gateway.upstream import RawHeaders

log = logging.getLogger("kvgate.proxy")


def declared_length(headers: RawHeaders) -> bytes | None:
    for name, value in headers:
        if len(name) == 14 and name.lower() == b"content-length":
            return value.strip()
    return None


async def pass_through(
    ex: Exchange,
    leg: Leg,
    metrics: GatewayMetrics,
    out_headers: list[tuple[bytes, bytes]],
    first_byte: Callable[[], None] | None,
) -> None:
    response = leg.response
    send, call = ex.send, ex.call
    # The last chunk goes out with the end of the response, as for streams (gateway.upstream).
    body_done = response.body_done
    try:
        chunk = await leg.next_chunk()
    except GatewayError as err:
        await send_error(ex, err, metrics)
        ex.status, ex.ok, ex.error_code = err.status, False, err.code
        return
    call.ttfb = time.perf_counter()
    call.started = True
    if first_byte is not None:
        first_byte()
    length = declared_length(response.headers)
    if length is not None and length.isdigit():
        out_headers.append((b"content-length", length))
    await send({"type": "http.response.start", "status": ex.status, "headers": out_headers})
    try:
        while True:
            if body_done():
                call.stop_watching()
                await send({"type": "http.response.body", "body": chunk, "more_body": False})
                ex.ok = ex.status < 400
                return
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            chunk = await leg.next_chunk()
            if not chunk and body_done() is not False:
                break
    except GatewayError as err:
        log.warning("upstream %s failed mid-body: %s", leg.replica, err.message)
        metrics.error(err.code or "upstream_error")
        ex.ok, ex.error_code = False, err.code or "upstream_error"
        return  # incomplete on purpose: the connection is dropped (see the module's doc)
    call.stop_watching()
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    ex.ok = ex.status < 400
