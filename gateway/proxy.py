"""The request path: parse, key, admit, choose, forward with retries, relay, account.

One `ProxyEndpoint` per OpenAI route, a raw ASGI callable (no Request/Response objects on
the hot path). Order of work for one request:

1. read the body (size limit), check content type, parse JSON, validate fields, 404 an
   unknown model, build the `RouteRequest` (gateway.keys);
2. start watching for the client's `http.disconnect` (cancels the work at once);
3. `state.placements.lookup` -> sticky replica; `state.admission.classify` -> class;
4. `state.router.choose(request, cluster.view())` once; when admission is on and the chosen
   replica is saturated, wait in `state.admission` (gateway.admission); then fail over down the ranking
   with tenacity (retryable errors only, never the same replica twice, bounded in attempts
   and time) until response headers arrive -- `state.dispatcher` may take over a leg here;
5. relay status + end-to-end headers, then the body: streams chunk by chunk unbuffered,
   other bodies in one message; never retry once a byte went out;
6. in `finally`: close the upstream leg (closing the connection if not drained), release
   the in-flight slot (and tell admission), tell the router and the observers.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, stop_after_delay
from tenacity.wait import wait_fixed, wait_none

from gateway.body import ClientGone, check_content_type, parse_json, read_body, validate
from gateway.disconnect import CallState as _Call
from gateway.errors import (
    BadRequest,
    GatewayError,
    ModelNotFound,
    NoHealthyReplica,
    error_response_parts,
)
from gateway.forward import Leg, name_replica, open_leg
from gateway.hooks import ForwardContext, RequestOutcome
from gateway.keys import route_request
from gateway.middleware.request_id import accepted_request_id
from gateway.pd.decision import without_client_pd_fields
from gateway.state import GatewayState
from gateway.stream_usage import UsageStripper, inject_usage
from gateway.types import Choice, Endpoint, ReplicaId, RouteRequest
from gateway.upstream import request_headers, response_headers
from gateway.usage import USAGE_TAIL_BYTES as _USAGE_TAIL_BYTES
from gateway.usage import usage_from_json, usage_from_sse, usage_tokens

log = logging.getLogger("kvgate.proxy")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

REQUEST_ID_SCOPE_KEY = "kvgate.request_id"
REPLICA_HEADER = b"x-kvgate-replica"
_SSE = b"text/event-stream"


class _RequestIds:
    """Ids unique across processes without a syscall per request: a random per-endpoint
    prefix (8 bytes from the OS) and a counter."""

    __slots__ = ("_next", "_prefix")

    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._next = itertools.count(1).__next__

    def __call__(self) -> str:
        return f"{self._prefix}{self._next():08x}"


class _Exhausted(Exception):
    """Every candidate replica was tried."""


def _declared_length(value: bytes | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise BadRequest("invalid Content-Length header") from None


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, GatewayError) and exc.retryable


class ProxyEndpoint:
    """ASGI app forwarding one OpenAI route (`path`) to the replicas."""

    def __init__(self, state: GatewayState, endpoint: Endpoint, path: str) -> None:
        self.state = state
        self.endpoint = endpoint
        self.path = path
        # Only these endpoints stream tokens with an optional usage event.
        self._may_inject_usage = endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS)
        self._new_id = _RequestIds()
        s = state.settings
        self._session_header = s.session.header.lower().encode("latin-1")
        self._priority_header = s.session.priority_header.lower().encode("latin-1")
        self._tenant_header = s.session.tenant_header.lower().encode("latin-1")
        self._lineage_key = state.lineage.key_for if state.lineage is not None else None
        self._strip_pd = not s.pd.allow_client_fields
        retries = s.retries
        self._backoff_s = retries.backoff_s
        # Attempts after the first, bounded in count and in time since the first failure.
        self._retrying: AsyncRetrying | None = None
        if retries.max_attempts > 1:
            self._retrying = AsyncRetrying(
                stop=stop_after_attempt(retries.max_attempts - 1) | stop_after_delay(retries.budget_s),
                retry=retry_if_exception(_retryable),
                wait=wait_fixed(retries.backoff_s) if retries.backoff_s else wait_none(),
                reraise=True,
            )

    # -- ASGI entry ---------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = _Call(asyncio.current_task())
        try:
            await self._handle(scope, receive, send, call)
        except Exception as exc:
            # The outermost boundary: a bug must still answer in OpenAI's shape, not 500 text.
            log.exception("unhandled error in %s", self.path)
            self.state.metrics.error("internal_error")
            if not call.started:
                err = GatewayError(f"internal gateway error ({type(exc).__name__})")
                status, headers, body = error_response_parts(err)
                headers.append((b"x-request-id", call.request_id or self._new_id().encode()))
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _handle(self, scope: Scope, receive: Receive, send: Send, call: _Call) -> None:
        started_at = time.time()
        t0 = time.perf_counter()
        state = self.state
        content_type = content_length = session = priority = tenant = client_id = None
        sh, ph, th = self._session_header, self._priority_header, self._tenant_header
        for name, value in scope["headers"]:
            if name == b"content-type":
                content_type = value
            elif name == b"content-length":
                content_length = value
            elif name == sh:
                session = value
            elif name == ph:
                priority = value
            elif name == th:
                tenant = value
            elif name == b"x-request-id":
                client_id = value
        # The request-id middleware is skipped on the fast path (gateway.fastpath); the
        # same rule is applied here: keep a sane client id, else mint one.
        request_id: str | None = scope.get(REQUEST_ID_SCOPE_KEY)
        forward_id = False  # only a minted id is added to what the engine gets
        if request_id is None:
            request_id = accepted_request_id(client_id)
            if request_id is None:
                request_id = self._new_id()
                forward_id = True
        call.request_id = request_id.encode()
        try:
            check_content_type(content_type)
            declared = _declared_length(content_length)
            raw = await read_body(receive, state.settings.limits.max_body_bytes, declared)
            body = parse_json(raw, state.settings.limits.max_json_depth)
            model = validate(body, self.endpoint)
            rewritten = False
            if state.resolve_model is not None and (served := state.resolve_model(model)) != model:
                # An alias: the engines only know the served name.
                body = {**body, "model": served}
                rewritten = True
                model = served
            if self._strip_pd and (stripped := without_client_pd_fields(body)) is not None:
                body, rewritten = stripped, True
            known = state.cluster.known_models()
            if known is not None and model not in known:
                raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
            session_cfg = state.settings.session
            request = route_request(
                body,
                self.endpoint,
                request_id,
                session_header=session.decode("latin-1") if session else None,
                block_tokens=session_cfg.block_tokens,
                max_prefix_blocks=session_cfg.max_prefix_blocks,
                completion_key_chars=session_cfg.completion_key_chars,
                priority_class=priority.decode("latin-1") if priority else None,
                tenant=tenant.decode("latin-1") if tenant else None,
                user_is_session=session_cfg.user_is_session,
                lineage=self._lineage_key,
            )
            # The one place the forwarded body changes: every later rewrite (admission's
            # payload, the PD legs) starts from this body/raw pair (gateway.stream_usage).
            strip_usage = False
            if state.observers and self._may_inject_usage:
                injected = inject_usage(body)
                if injected is not None:
                    body, strip_usage = injected
                    rewritten = True
            if rewritten:
                raw = orjson.dumps(body)
        except ClientGone:
            state.metrics.disconnect("before_response")
            self._finish(None, request_id, None, 499, False, t0, started_at, call, 0, None, "client_gone")
            return
        except GatewayError as err:
            await self._send_error(send, err, call)
            self._finish(None, request_id, None, err.status, False, t0, started_at, call, 0, None, err.code)
            return

        fwd_headers = request_headers(scope["headers"])
        if forward_id:
            if client_id is not None:
                fwd_headers = [h for h in fwd_headers if h[0] != b"x-request-id"]
            fwd_headers.append((b"x-request-id", call.request_id))
        # The query string goes along unchanged (vLLM ignores it; a proxy must not eat it).
        query: bytes = scope.get("query_string", b"")
        path = self.path + "?" + query.decode("latin-1") if query else self.path
        call.watch(receive)
        try:
            await self._route_and_relay(
                request, body, raw, fwd_headers, send, call, t0, started_at, path, strip_usage
            )
        except asyncio.CancelledError:
            if not call.disconnected:
                raise
            # Our own cancellation (the client left): absorb it, everything is closed.
            task = call.task
            if task is not None:
                task.uncancel()
        finally:
            call.active = False
            call.close_watcher()

    # -- routing + forwarding -----------------------------------------------------------
    async def _route_and_relay(
        self,
        request: RouteRequest,
        body: dict[str, Any],
        raw: bytes,
        headers: list[tuple[bytes, bytes]],
        send: Send,
        call: _Call,
        t0: float,
        started_at: float,
        path: str,
        strip_usage: bool = False,
    ) -> None:
        state = self.state
        leg: Leg | None = None
        retries = 0
        status = 0
        ok = False
        error_code: str | None = None
        usage: dict[str, Any] | None = None
        # Admission's and the router's prefill signals: once, at the first byte or at the end.
        notify: Callable[[RouteRequest, ReplicaId | None], None] | None = getattr(
            state.admission, "first_byte", None
        )
        tracker = state.router_prefill
        prefilling = notify is not None or tracker is not None

        def first_byte() -> None:
            nonlocal prefilling
            if prefilling:
                prefilling = False
                if notify is not None:
                    notify(request, leg.replica if leg is not None else None)
                if tracker is not None:
                    tracker.prefilled(request)

        try:
            placements = state.placements
            if placements is not None:
                sticky = await placements.lookup(request.session_key)
                if sticky is not None:
                    # Nobody else holds this fresh request yet: set the field in place
                    # instead of paying for dataclasses.replace on every request.
                    object.__setattr__(request, "sticky_replica", sticky)
            try:
                if state.admission is not None:
                    request = state.admission.classify(request, body, headers)
                leg, retries = await self._open(request, body, raw, headers, path)
            except GatewayError as err:
                status, error_code = err.status, err.code
                await self._send_error(send, err, call)
                return
            if placements is not None and request.sticky_replica != leg.replica:
                await placements.record(request.session_key, leg.replica)
            if state.router_placed is not None:
                state.router_placed(request, leg.replica)
            if state.lineage is not None and request.key_source == "lineage":
                state.lineage.fit(state.cluster.view().replicas)
                state.lineage.record(
                    request.lineage_hashes, request.session_key, request.lineage_tail
                )
            status = leg.response.status
            status, ok, error_code, usage = await self._relay(
                leg, send, call, strip_usage, first_byte if prefilling else None
            )
        except OSError:
            # The ASGI server refused a send: the client is gone (transport errors of the
            # upstream arrive as GatewayError, never as OSError).
            call.disconnected = True
        finally:
            replica = leg.replica if leg is not None else None
            try:
                if leg is not None:
                    await leg.aclose()
            finally:
                first_byte()
                if state.admission is not None:
                    state.admission.finished(request, replica)
            if call.disconnected:
                state.metrics.disconnect("mid_stream" if call.started else "before_response")
                ok = False
                error_code = error_code or "client_gone"
                if not status:
                    status = 499
            self._finish(request, request.request_id, replica, status, ok, t0, started_at, call, retries, usage, error_code, body, headers)

    def _candidate(self, choice: Choice, tried: list[ReplicaId]) -> ReplicaId | None:
        cluster = self.state.cluster
        for replica in choice.ranked:
            if replica not in tried and cluster.is_healthy(replica) and replica in cluster.members:
                return replica
        return None

    async def _open(
        self,
        request: RouteRequest,
        body: dict[str, Any],
        raw: bytes,
        headers: list[tuple[bytes, bytes]],
        path: str,
    ) -> tuple[Leg, int]:
        """Choose and open a leg to `path` (the route plus the client's query string),
        failing over down the ranking on retryable errors."""
        state = self.state
        cluster = state.cluster
        view = cluster.view()
        choice = state.router.choose(request, view)
        state.metrics.decision(choice.policy or type(state.router).__name__, choice.reason)
        gate = state.admission
        if gate is not None:
            target = self._candidate(choice, [])
            if target is not None and gate.must_wait(request, target, view):
                await gate.wait(request, target)
                view = cluster.view()
        tried: list[ReplicaId] = []
        last_error: GatewayError | None = None

        async def open_to(replica: ReplicaId, payload: bytes, hdrs: list[tuple[bytes, bytes]] | None = None) -> Leg:
            return await open_leg(
                cluster, state.client, state.health, replica, path, headers if hdrs is None else hdrs, payload
            )

        async def attempt() -> Leg:
            nonlocal choice, last_error
            replica = self._candidate(choice, tried)
            if replica is None and tried:
                # The ranking is used up: ask again, health may have changed.
                choice = state.router.choose(request, cluster.view())
                replica = self._candidate(choice, tried)
            if replica is None:
                if last_error is not None:
                    raise _Exhausted()
                raise NoHealthyReplica(f"no healthy replica serves model {request.model!r}")
            if tried:
                state.metrics.retry(last_error.code if last_error and last_error.code else "error")
                state.metrics.decision(choice.policy or type(state.router).__name__, "failover")
            tried.append(replica)
            if state.router_prefill is not None:
                state.router_prefill.dispatched(request, replica)
            try:
                if state.dispatcher is not None:
                    ctx = ForwardContext(request, body, raw, path, headers, choice, view, open_to)
                    leg = await state.dispatcher.dispatch(ctx)
                    if leg is not None:
                        return leg
                payload = raw if gate is None else gate.payload(request, body, raw, replica)
                # Straight to open_leg, not through open_to: one coroutine less per request.
                return await open_leg(
                    cluster, state.client, state.health, replica, path, headers, payload
                )
            except GatewayError as err:
                last_error = err
                state.metrics.upstream_failure(replica, err.code or "error")
                raise

        try:
            # The first attempt runs bare (the common case pays nothing for tenacity); the
            # retry policy itself is declared once, in self._retrying.
            try:
                return await attempt(), 0
            except GatewayError as err:
                if not err.retryable or self._retrying is None:
                    raise
            if self._backoff_s:
                await asyncio.sleep(self._backoff_s)
            async for retry in self._retrying.copy():
                with retry:
                    return await attempt(), len(tried) - 1
        except _Exhausted:
            assert last_error is not None
            raise last_error from None
        raise AssertionError("unreachable: tenacity either returns or raises")

    async def _relay(
        self,
        leg: Leg,
        send: Send,
        call: _Call,
        strip_usage: bool = False,
        first_byte: Callable[[], None] | None = None,
    ) -> tuple[int, bool, str | None, dict[str, Any] | None]:
        """Send the leg's response to the client. Returns status, ok, error code, usage.

        `strip_usage`: the gateway asked for usage the client did not want; the usage-only
        event is taken out of the stream (and is where the usage comes from).
        """
        response = leg.response
        status = response.status
        out_headers = response_headers(response.headers)
        out_headers.append((REPLICA_HEADER, leg.replica.encode()))
        out_headers.append((b"x-request-id", call.request_id))
        streaming = any(n == b"content-type" and v.startswith(_SSE) for n, v in out_headers)
        want_usage = bool(self.state.observers)
        if not streaming:
            try:
                payload = await response.read()
            except GatewayError as err:
                name_replica(err, leg.replica)
                await self._send_error(send, err, call)
                return err.status, False, err.code, None
            call.stop_watching()
            call.ttfb = time.perf_counter()
            call.started = True
            if first_byte is not None:
                first_byte()
            out_headers.append((b"content-length", b"%d" % len(payload)))
            await send({"type": "http.response.start", "status": status, "headers": out_headers})
            await send({"type": "http.response.body", "body": payload, "more_body": False})
            usage = usage_from_json(payload) if want_usage and status < 400 else None
            return status, status < 400, None, usage

        iterator = response.iter_bytes()
        # The last chunk goes out with the end of the response (one write) when the client
        # can tell the body is complete without another read.
        body_done: Callable[[], bool] | None = getattr(response, "body_done", None)
        tail = b""
        stripper = UsageStripper() if strip_usage else None
        error_code: str | None = None
        try:
            chunk = await anext(iterator, b"")
        except GatewayError as err:
            name_replica(err, leg.replica)
            await self._send_error(send, err, call)
            return err.status, False, err.code, None
        call.ttfb = time.perf_counter()
        call.started = True
        if first_byte is not None:
            first_byte()
        await send({"type": "http.response.start", "status": status, "headers": out_headers})
        ended = False
        try:
            while True:
                if chunk:
                    if stripper is not None:
                        chunk = stripper.feed(chunk)
                    elif want_usage:
                        tail = (tail + chunk)[-_USAGE_TAIL_BYTES:]
                if body_done is not None and body_done():
                    if stripper is not None:
                        chunk += stripper.flush()
                    call.stop_watching()
                    ended = True
                    await send({"type": "http.response.body", "body": chunk, "more_body": False})
                    break
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                chunk = await anext(iterator, b"")
                if not chunk and (body_done is None or body_done()):
                    break
        except GatewayError as err:
            # Too late for a status code: tell SSE clients in-band, the way vLLM does.
            error_code = err.code or "upstream_error"
            name_replica(err, leg.replica)
            log.warning("upstream %s failed mid-stream: %s", leg.replica, err.message)
            if stripper is not None and (held := stripper.flush()):
                await send({"type": "http.response.body", "body": held, "more_body": True})
            await send({"type": "http.response.body", "body": b"data: " + err.body() + b"\n\n", "more_body": True})
        if not ended:
            if stripper is not None and (held := stripper.flush()):
                await send({"type": "http.response.body", "body": held, "more_body": True})
            call.stop_watching()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        if stripper is not None:
            usage = stripper.usage
        else:
            usage = usage_from_sse(tail) if want_usage else None
        return status, error_code is None and status < 400, error_code, usage

    # -- helpers ------------------------------------------------------------------------
    async def _send_error(self, send: Send, err: GatewayError, call: _Call) -> None:
        status, headers, body = error_response_parts(err)
        headers.append((b"x-request-id", call.request_id))
        self.state.metrics.error(err.code or "error")
        call.stop_watching()
        call.ttfb = time.perf_counter()
        call.started = True
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def _finish(
        self,
        request: RouteRequest | None,
        request_id: str,
        replica: ReplicaId | None,
        status: int,
        ok: bool,
        t0: float,
        started_at: float,
        call: _Call,
        retries: int,
        usage: dict[str, Any] | None,
        error_code: str | None,
        body: dict[str, Any] | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        state = self.state
        now = time.perf_counter()
        latency = now - t0
        ttfb = call.ttfb - t0 if call.ttfb is not None else None
        stream = request.stream if request is not None else False
        state.metrics.request_done(self.endpoint.value, replica or "", status, stream, latency, ttfb)
        if request is not None and replica is not None and state.router_finished is not None:
            state.router_finished(request, replica, ok, latency)
        observers = state.observers
        if not observers:
            return
        prompt, cached, completion = usage_tokens(usage)
        outcome = RequestOutcome(
            request=request,
            request_id=request_id,
            endpoint=self.endpoint.value,
            replica=replica,
            status=status,
            ok=ok,
            stream=stream,
            prompt_tokens=prompt,
            cached_tokens=cached,
            completion_tokens=completion,
            ttfb_s=ttfb,
            latency_s=latency,
            retries=retries,
            disconnected=call.disconnected,
            error_code=error_code,
            started_at=started_at,
            body=body,
            headers=headers,
        )
        for observer in observers:
            try:
                observer(outcome)
            except Exception:  # an observer bug must not break the response path
                log.exception("outcome observer %r failed", observer)
