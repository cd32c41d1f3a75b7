"""Relay stage: the leg's status, end-to-end headers and body to the client.

Three kinds of body, by the engine's content type:

* SSE streams go chunk by chunk, unbuffered; a failure mid-stream is told in-band, in the
  route's dialect, the way vLLM does.
* JSON (and a body with no content type) is read whole, bounded by the client's
  `max_response_bytes`, because the gateway reads it (usage, a Response's id) and can still
  turn a failure into a clean 502; it goes out in one message.
* Anything else (audio from /v1/audio/speech, text transcripts) is passed through as it
  arrives, with the engine's Content-Length when it sent one, never held whole nor bounded.
  Once its first byte went out a failure cannot be told in it: the response is left
  incomplete, so the server drops the connection and the client sees a short body.

Nothing is retried once a byte went out. The result (status, ok, error code, usage) is
written to the exchange for the outcome stage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from gateway.errors import GatewayError, stream_error_event
from gateway.forward import Leg
from gateway.metrics import GatewayMetrics
from gateway.proxy.continuation import id_in_json, id_in_stream
from gateway.proxy.exchange import Exchange
from gateway.proxy.passthrough import pass_through
from gateway.proxy.respond import send_error
from gateway.scope import HEAD_HOLDER_KEY, TICKET_KEY, QuotaCharge
from gateway.stream_usage import UsageStripper
from gateway.types import ROUTE_SPECS
from gateway.upstream import response_headers
from gateway.usage import USAGE_TAIL_BYTES, usage_from_json, usage_from_sse, usage_tokens

log = logging.getLogger("kvgate.proxy")

REPLICA_HEADER = b"x-kvgate-replica"
_SSE = b"text/event-stream"


def _read_whole(content_type: bytes) -> bool:
    """JSON bodies are read whole (the gateway may parse them); others pass through."""
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or media.endswith(b"+json")


async def relay(
    ex: Exchange,
    leg: Leg,
    metrics: GatewayMetrics,
    want_usage: bool,
    first_byte: Callable[[], None] | None = None,
    keep: Callable[[str], Awaitable[None]] | None = None,
) -> None:
    """Send `leg`'s response. `want_usage`: read `usage` for the observers; with
    `ex.strip_usage` the gateway asked for a usage event the client did not want, so it is
    taken out of the stream (and is where the usage comes from). `keep` is awaited with the
    id of an answer the engine stored before any byte carrying that id is sent, so a client
    that continues it at once, through any gateway, finds it recorded."""
    response = leg.response
    send, call = ex.send, ex.call
    status = ex.status = response.status
    out_headers = response_headers(response.headers)
    out_headers.append((REPLICA_HEADER, leg.replica.encode()))
    content_type = next((v for n, v in out_headers if n == b"content-type"), None)
    streaming = content_type is not None and content_type.startswith(_SSE)
    if not streaming and content_type is not None and not _read_whole(content_type):
        await pass_through(ex, leg, metrics, out_headers, first_byte)
        return
    if not streaming:
        try:
            payload = await leg.read()
        except GatewayError as err:
            await send_error(ex, err, metrics)
            ex.status, ex.ok, ex.error_code = err.status, False, err.code
            return
        call.stop_watching()
        call.ttfb = time.perf_counter()
        call.started = True
        if first_byte is not None:
            first_byte()
        if ex.find_response_id and status < 400:
            ex.response_id = id_in_json(payload)
            if ex.response_id is not None and keep is not None:
                await keep(ex.response_id)
        out_headers.append((b"content-length", b"%d" % len(payload)))
        if (holder := ex.scope.get(HEAD_HOLDER_KEY)) is not None:
            holder.hold()  # the body follows at once: one write for both
        await send({"type": "http.response.start", "status": status, "headers": out_headers})
        await send({"type": "http.response.body", "body": payload, "more_body": False})
        ex.ok = status < 400
        ex.usage = usage_from_json(payload) if want_usage and ex.ok else None
        return

    # The last chunk goes out with the end of the response (one write) when the client
    # can tell the body is complete without another read.
    body_done = response.body_done
    tail = b""
    stripper = UsageStripper() if ex.strip_usage else None
    error_code: str | None = None
    try:
        # open_leg read the first chunk of the streams it opened; PD legs are not peeked.
        chunk = await leg.next_chunk()
    except GatewayError as err:
        await send_error(ex, err, metrics)
        ex.status, ex.ok, ex.error_code = err.status, False, err.code
        return
    call.ttfb = time.perf_counter()
    call.started = True
    if first_byte is not None:
        first_byte()
    # Time to first *token* (not byte), inter-token latency and TPOT: on the raw chunks,
    # before any usage event is stripped.
    request = ex.request
    timer = metrics.stream_timer(request.model if request else "", leg.replica, ex.t0)
    ended = False
    seek_id = ex.find_response_id and status < 400
    if chunk and not seek_id and (holder := ex.scope.get(HEAD_HOLDER_KEY)) is not None:
        holder.hold()  # the first chunk, in hand, goes with the head
    await send({"type": "http.response.start", "status": status, "headers": out_headers})
    # A quota ticket is charged for output tokens as they go out, past its estimate
    # (gateway.auth.limiter): a stream dropped midway still pays for what it got.
    ticket: QuotaCharge | None = ex.scope.get(TICKET_KEY)
    relayed = before = b""  # the last two chunks out: where a failure event continues from
    try:
        while True:
            if chunk:
                before, relayed = relayed, chunk
                timer.feed(chunk)
                if seek_id and (found := id_in_stream(chunk)) is not None:
                    ex.response_id, seek_id = found, False
                    if keep is not None:
                        await keep(found)
                if stripper is not None:
                    chunk = stripper.feed(chunk)
                elif want_usage:
                    tail = (tail + chunk)[-USAGE_TAIL_BYTES:]
            if body_done():
                if stripper is not None:
                    chunk += stripper.flush()
                call.stop_watching()
                ended = True
                await send({"type": "http.response.body", "body": chunk, "more_body": False})
                if ticket is not None:
                    ticket.delivered(timer.token_events)
                break
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if ticket is not None:
                    ticket.delivered(timer.token_events)
            chunk = await leg.next_chunk()
            if not chunk and body_done() is not False:
                break
    except GatewayError as err:
        error_code = err.code or "upstream_error"
        log.warning("upstream %s failed mid-stream: %s", leg.replica, err.message)
        if stripper is not None and (held := stripper.flush()):
            await send({"type": "http.response.body", "body": held, "more_body": True})
        shape = ROUTE_SPECS[request.endpoint].events if request is not None else ex.errors
        event = stream_error_event(err, shape, before + relayed)
        if relayed and not relayed.endswith((b"\n\n", b"\r\n\r\n")):
            # The engine stopped inside an event: end it, so the error is an event of its own.
            event = b"\n\n" + event
        await send({"type": "http.response.body", "body": event, "more_body": True})
    if not ended:
        if stripper is not None and (held := stripper.flush()):
            await send({"type": "http.response.body", "body": held, "more_body": True})
        call.stop_watching()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    if stripper is not None:
        ex.usage = stripper.usage
    else:
        ex.usage = usage_from_sse(tail) if want_usage else None
    timer.finish(usage_tokens(ex.usage)[2])
    trace = ex.trace
    if trace is not None and (ttft := timer.ttft_s) is not None:
        trace.first_token(int((ex.started_at + ttft) * 1e9), leg.replica)
    ex.ok = error_code is None and status < 400
    ex.error_code = error_code
