"""One ext_proc stream: one request, through the proxy's own stages, forwarded by Envoy.

Request path: the headers are held until the body's end (bounded by `epp.body_timeout_s`),
then the proxy's inbound stage reads the body (limits, JSON, model, `RouteRequest`),
identity (sticky replica, class) and the shared decision (gateway.proxy.decide) choose,
and one HeadersResponse names the ranked endpoints; the body follows in chunks of at most
`epp.chunk_bytes`, rewritten where kvgate rewrites it (alias, usage request, priority).

Response path: the served endpoint (the `envoy.lb` metadata, else the `upstream.address`
attribute) moves the in-flight slot when Envoy failed over; the first body chunk is the
first byte; the end of the stream (or of the gRPC stream: the client left) settles the
request through the proxy's settle stage (slot, admission, router, metrics, observers).
A stream's chunk costs one protobuf parse and one build, the SSE timer's newline count,
and a bounded copy of its tail when usage is wanted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, ClassVar

from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse

from gateway.asgi import Message
from gateway.epp import wire
from gateway.errors import GatewayError, NoHealthyReplica, PayloadTooLarge, error_response_parts
from gateway.forward import Leg
from gateway.proxy.continuation import id_in_json, id_in_stream, response_key
from gateway.proxy.decide import FirstByte, candidate, decide, dispatched, mark_placed
from gateway.proxy.exchange import Exchange
from gateway.stream_usage import UsageStripper
from gateway.types import ROUTE_SPECS, Choice, ReplicaId, RouteRequest
from gateway.usage import USAGE_TAIL_BYTES, usage_from_json, usage_from_sse, usage_tokens

if TYPE_CHECKING:
    from gateway.epp.server import EppCore
    from gateway.token_timing import StreamTimer

log = logging.getLogger("kvgate.epp")

_SSE = b"text/event-stream"
_FORWARDED = (b"authorization", b"traceparent")  # headers the proxy may change for the engine
UPSTREAM_ADDRESS = "upstream.address"
_EXT_PROC_ATTRIBUTES = "envoy.filters.http.ext_proc"


class _Forwarded:
    """The leg's response as far as the gateway holds it: nothing (Envoy holds the bytes)."""

    status = 0
    headers: ClassVar[list[tuple[bytes, bytes]]] = []

    def iter_bytes(self) -> AsyncIterator[bytes]:
        raise NotImplementedError("Envoy forwards the body")

    async def read(self) -> bytes:
        raise NotImplementedError("Envoy forwards the body")

    def body_done(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


_FORWARDED_RESPONSE = _Forwarded()


async def _no_send(message: Message) -> None:
    raise AssertionError("the EPP answers through Envoy, not ASGI")


class EppStream:
    """The state of one ext_proc stream (a plain slotted class: one per request)."""

    __slots__ = (
        "_core",
        "_ended",
        "_first_byte",
        "_held",
        "_proxy",
        "_ranked",
        "_request",
        "_seek_id",
        "_settled",
        "_stripper",
        "_tail",
        "_timer",
        "_want_usage",
        "ex",
        "headers",
    )

    def __init__(self, core: EppCore) -> None:
        self._core = core
        self.ex: Exchange | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self._proxy: Any = None
        self._request: RouteRequest | None = None
        self._first_byte: FirstByte | None = None
        self._ranked: tuple[ReplicaId, ...] = ()
        self._settled = False
        self._ended = False
        self._timer: StreamTimer | None = None
        self._stripper: UsageStripper | None = None
        self._want_usage = False
        self._seek_id = False
        self._tail = b""
        self._held = bytearray()  # a JSON answer's bytes, for its usage (bounded)

    # -- the stream -----------------------------------------------------------------------
    async def run(
        self, requests: AsyncIterator[ProcessingRequest]
    ) -> AsyncIterator[ProcessingResponse]:
        first = await anext(requests, None)
        if first is None or first.WhichOneof("request") != "request_headers":
            return  # not a request stream (Envoy always opens with the request headers)
        self.headers = wire.headers_of(first.request_headers.headers)
        subset = wire.address_list(wire.metadata_value(first, wire.SUBSET_NAMESPACE, wire.SUBSET))
        body = bytearray()
        trailers = False
        if not first.request_headers.end_of_stream:
            limit = self._core.state.settings.limits.max_body_bytes
            try:
                async with asyncio.timeout(self._core.settings.body_timeout_s):
                    while True:
                        message = await anext(requests, None)
                        if message is None:
                            return  # Envoy closed the stream before the body ended
                        kind = message.WhichOneof("request")
                        if kind == "request_body":
                            body += message.request_body.body
                            if len(body) > limit:
                                yield self._refuse(
                                    PayloadTooLarge(f"request body exceeds {limit} bytes")
                                )
                                return
                            if message.request_body.end_of_stream:
                                break
                        elif kind == "request_trailers":
                            trailers = True
                            break
            except TimeoutError:
                yield self._refuse(_BodyTimeout("the request body did not arrive in time"))
                return
        async for out in self._decide(bytes(body), subset, trailers):
            yield out
        if self.ex is None or self._settled:
            return  # answered by the gateway itself (an ImmediateResponse)
        async for message in requests:
            kind = message.WhichOneof("request")
            if kind == "response_body":
                yield self._response_body(message.response_body)
            elif kind == "response_headers":
                yield await self._response_headers(message)
            elif kind == "response_trailers":
                await self._finish()
                yield wire.EMPTY_RESPONSE_TRAILERS
            elif kind == "request_trailers":
                yield wire.EMPTY_REQUEST_TRAILERS
            if self._ended and not self._settled:
                await self._finish()

    async def close(self) -> None:
        """Always, once the stream is over: a request that did not end was left by its
        client (or Envoy): it is settled as a disconnect."""
        ex = self.ex
        if ex is None or self._settled or self._request is None or self._first_byte is None:
            return
        if self._ended:
            # The answer ended but Envoy reset the stream before the loop settled it (it may
            # as soon as it holds the last body chunk): settle it as served, usage and all.
            await self._finish()
            return
        ex.call.disconnected = True
        self._settled = True
        await self._proxy.settle(ex, self._request, self._first_byte)

    # -- request path ----------------------------------------------------------------------
    def _refuse(self, err: GatewayError, reason: str | None = None) -> ProcessingResponse:
        status, headers, body = error_response_parts(err)
        self._core.state.metrics.error(err.code or "error")
        return wire.immediate(status, headers, body, reason)

    async def _decide(
        self, body: bytes, subset: list[str] | None, trailers: bool
    ) -> AsyncIterator[ProcessingResponse]:
        core = self._core
        state = core.state
        headers = self.headers
        method = path = b""
        plain: list[tuple[bytes, bytes]] = []
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b":method":
                method = value
            elif not name.startswith(b":"):
                plain.append((name, value))
        route_path, _, query = path.decode("latin-1").partition("?")
        route = core.routes.get(route_path) if method == b"POST" else None
        if route is None:
            # Not an OpenAI call the gateway routes (GET /v1/models, health): any replica.
            async for out in self._pass(body, subset, trailers):
                yield out
            return
        proxy, inbound, outcome = route
        self._proxy = proxy
        scope: dict[str, Any] = {
            "type": "http",
            "method": "POST",
            "path": route_path,
            "headers": plain,
            "query_string": query.encode("latin-1"),
        }

        async def receive() -> Message:
            return {"type": "http.request", "body": body, "more_body": False}

        t0 = time.perf_counter()
        ex = self.ex = Exchange(
            scope, receive, _no_send, _call_state(), core.request_id(plain), t0, time.time()
        )
        ex.errors = ROUTE_SPECS[proxy.endpoint].errors
        try:
            await inbound.read(ex)
        except GatewayError as err:
            ex.status, ex.error_code = err.status, err.code
            self._settled = True
            yield self._refuse(err)
            outcome.finish(ex, None)
            return
        assert ex.request is not None
        request = self._request = ex.request
        first_byte = self._first_byte = FirstByte(state, ex, request)
        try:
            request = self._request = await proxy.identify(ex, request)
            choice, view = await decide(state, ex, request)
            ranked = self._ranked = self._eligible(choice, subset, ex.pools)
            if not ranked:
                raise NoHealthyReplica(
                    f"no healthy replica serves model {request.model!r}"
                    + (" in the subset hint" if subset is not None else "")
                )
        except GatewayError as err:
            ex.status, ex.error_code = err.status, err.code
            reason = "rejected-no-endpoints" if err.status == 503 else None
            if err.status == 429:
                reason = "rejected-saturated"
            yield self._refuse(err, reason)
            self._settled = True
            await proxy.settle(ex, request, first_byte)
            return
        primary = ranked[0]
        payload_body = ex.body or {}
        dispatched(state, request, primary, payload_body)
        if ex.upload is not None:
            payload = body  # a form goes as it came
        else:
            shape = state.payload
            payload = ex.raw if shape is None else shape(request, payload_body, ex.raw, primary)
        mark_placed(state, ex, request, view, choice, primary)
        state.cluster.acquire(primary)
        ex.leg = Leg(state.cluster, primary, _FORWARDED_RESPONSE)  # type: ignore[arg-type]
        answer = core.destination(
            ranked, plain, ex.headers, len(payload) if payload != body else None
        )
        core.decision_seconds.observe(time.perf_counter() - t0)
        yield answer
        for chunk in wire.request_body_chunks(payload, core.settings.chunk_bytes, end=not trailers):
            yield chunk

    def _eligible(
        self, choice: Choice, subset: list[str] | None, pools: frozenset[str] | None
    ) -> tuple[ReplicaId, ...]:
        """The ranking as the proxy would walk it (healthy members of the caller's pools),
        within the subset hint, at most `epp.max_endpoints` long."""
        core = self._core
        state = core.state
        members = state.cluster.members
        allowed = set(subset) if subset is not None else None
        out: list[ReplicaId] = []
        while len(out) < core.settings.max_endpoints:
            replica = candidate(state, choice, out, pools)
            if replica is None:
                break
            out.append(replica)
        if allowed is not None:
            out = [r for r in out if core.book.address(members, r) in allowed]
        return tuple(out)

    async def _pass(
        self, body: bytes, subset: list[str] | None, trailers: bool
    ) -> AsyncIterator[ProcessingResponse]:
        core = self._core
        ranked = core.any_replicas(subset)
        if not ranked:
            yield self._refuse(NoHealthyReplica("no healthy replica"), "rejected-no-endpoints")
            return
        yield core.destination(ranked, [], [], None)
        for chunk in wire.request_body_chunks(body, core.settings.chunk_bytes, end=not trailers):
            yield chunk

    # -- response path ---------------------------------------------------------------------
    async def _response_headers(self, message: ProcessingRequest) -> ProcessingResponse:
        ex, core = self.ex, self._core
        assert ex is not None and ex.leg is not None and self._request is not None
        state = core.state
        status = 0
        content_type = b""
        for name, value in wire.headers_of(message.response_headers.headers):
            if name == b":status":
                status = int(value or b"0")
            elif name == b"content-type":
                content_type = value
        ex.status = status
        served = self._served(message)
        leg = ex.leg
        if served is not None and served != leg.replica:
            # Envoy failed over down the list: the slot follows the replica that answered.
            ex.retries = max(1, self._ranked.index(served)) if served in self._ranked else 1
            state.metrics.retry("envoy_failover")
            state.metrics.upstream_failure(leg.replica, "envoy_failover")
            await leg.aclose()
            state.cluster.acquire(served)
            leg = ex.leg = Leg(state.cluster, served, _FORWARDED_RESPONSE)  # type: ignore[arg-type]
        await self._proxy.placed(ex, self._request, leg.replica)
        self._want_usage = bool(state.observers)
        self._seek_id = ex.find_response_id and status < 400
        if content_type.startswith(_SSE):
            model = self._request.model
            self._timer = state.metrics.stream_timer(model, leg.replica, ex.t0)
            if ex.strip_usage:
                self._stripper = UsageStripper()
        if message.response_headers.end_of_stream:
            self._mark_first_byte(token=False)
            self._conclude()
        return wire.response_headers([(core.replica_header, leg.replica.encode())])

    def _served(self, message: ProcessingRequest) -> ReplicaId | None:
        members = self._core.state.cluster.members
        book = self._core.book
        value = wire.metadata_value(message, wire.LB_NAMESPACE, wire.SERVED)
        if isinstance(value, str) and value:
            return book.replica(members, value.split(",", 1)[0].strip())
        attributes = message.attributes
        if _EXT_PROC_ATTRIBUTES in attributes:
            fields = attributes[_EXT_PROC_ATTRIBUTES].fields
            if UPSTREAM_ADDRESS in fields:
                return book.replica(members, fields[UPSTREAM_ADDRESS].string_value)
        return None

    def _mark_first_byte(self, token: bool = True) -> None:
        """`token`: a body chunk, the first token (a prefill-speed sample); else the
        response ended without one."""
        ex = self.ex
        assert ex is not None
        call = ex.call
        if not call.started:
            call.ttfb = time.perf_counter()
            call.started = True
            ex.reached = True
            if self._first_byte is not None:
                if token:
                    self._first_byte.token()
                else:
                    self._first_byte()

    def _response_body(self, body: Any) -> ProcessingResponse:
        chunk: bytes = body.body
        end: bool = body.end_of_stream
        ex = self.ex
        assert ex is not None
        self._mark_first_byte()
        timer = self._timer
        if timer is not None:
            if chunk:
                timer.feed(chunk)
                if self._seek_id and (found := id_in_stream(chunk)) is not None:
                    ex.response_id, self._seek_id = found, False
                stripper = self._stripper
                if stripper is not None:
                    chunk = stripper.feed(chunk)
                elif self._want_usage:
                    self._tail = (self._tail + chunk)[-USAGE_TAIL_BYTES:]
            if end and self._stripper is not None:
                chunk += self._stripper.flush()
        elif (self._want_usage or self._seek_id) and len(self._held) + len(chunk) <= _held_limit(
            self._core
        ):
            self._held += chunk
        if end:
            self._conclude()
        return wire.response_body(chunk, end)

    def _conclude(self) -> None:
        """The answer ended: read its usage and id now, before the last chunk is handed back,
        since Envoy may reset the stream the moment it has it."""
        ex = self.ex
        if ex is None or self._ended:
            return
        self._ended = True
        ex.ok = 0 < ex.status < 400
        if self._timer is not None:
            if self._stripper is not None:
                ex.usage = self._stripper.usage
            else:
                ex.usage = usage_from_sse(self._tail) if self._want_usage else None
            self._timer.finish(usage_tokens(ex.usage)[2])
        elif self._held:
            held = bytes(self._held)
            ex.usage = usage_from_json(held) if self._want_usage and ex.ok else None
            if ex.find_response_id and ex.ok:
                ex.response_id = id_in_json(held)

    async def _finish(self) -> None:
        ex = self.ex
        if ex is None or self._settled:
            return
        assert self._request is not None and self._first_byte is not None
        self._conclude()
        self._settled = True
        state = self._core.state
        try:
            if ex.response_id is not None and state.placements is not None and ex.leg is not None:
                await state.placements.record(response_key(ex.response_id), ex.leg.replica)
        finally:
            await self._proxy.settle(ex, self._request, self._first_byte)


def _held_limit(core: EppCore) -> int:
    return core.state.settings.limits.max_response_bytes


def _call_state() -> Any:
    from gateway.disconnect import CallState

    return CallState(asyncio.current_task())


class _BodyTimeout(GatewayError):
    status = 408
    error_type = "invalid_request_error"
    code = "request_body_timeout"
