"""`ProxyEndpoint`: one OpenAI route, a raw ASGI callable running the request pipeline.

It runs behind the front chain (gateway.fastpath: request id, auth, rate limit), which
every route shares. Per request, on one `Exchange`:

1. inbound (gateway.proxy.inbound): body limits, JSON, model -> `RouteRequest`;
2. start watching for the client's `http.disconnect` (cancels the work at once); for an
   upload streamed through (gateway.upload), once its last body message was read;
3. identity: the session's sticky replica (`state.placements`), the priority class
   (`state.admission.classify`);
4. routing, admission and attempts (gateway.proxy.attempts) until response headers arrive;
5. relay (gateway.proxy.relay): never retried once a byte went out;
6. in `finally`: close the leg, release admission's slot and the prefill signals, then the
   outcome (gateway.proxy.outcome): metrics, the router, the observers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from functools import partial

from gateway.asgi import Receive, Scope, Send
from gateway.body import ClientGone
from gateway.disconnect import CallState
from gateway.errors import GatewayError, NotFound, error_response_parts
from gateway.hooks import RequestTracer, SessionPlacements
from gateway.proxy.attempts import Attempts
from gateway.proxy.continuation import chain_key, may_use, remember
from gateway.proxy.decide import FirstByte, place
from gateway.proxy.exchange import Exchange
from gateway.proxy.identity import Identity, with_key, with_sticky
from gateway.proxy.inbound import Inbound
from gateway.proxy.outcome import Outcome
from gateway.proxy.relay import relay
from gateway.proxy.respond import send_error
from gateway.proxy.tiered import run_tiered
from gateway.request_id import RequestIds
from gateway.scope import REQUEST_ID_KEY, TICKET_KEY
from gateway.state import GatewayState
from gateway.types import ROUTE_SPECS, Endpoint, ReplicaId, RouteRequest

log = logging.getLogger("kvgate.proxy")


class ProxyEndpoint:
    """ASGI app forwarding one OpenAI route (`path`) to the replicas."""

    def __init__(self, state: GatewayState, endpoint: Endpoint, path: str) -> None:
        self.state = state
        self.endpoint = endpoint
        self.path = path
        self._inbound = Inbound(state, endpoint, path)
        self._errors = ROUTE_SPECS[endpoint].errors
        self._identity = Identity(state)
        self._attempts = Attempts(state)
        self._outcome = Outcome(state, endpoint)
        # Only for a scope that did not come through the front chain (a bare mount).
        self._new_id = RequestIds()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = CallState(asyncio.current_task())
        request_id: str = scope.get(REQUEST_ID_KEY) or self._new_id()
        ex = Exchange(scope, receive, send, call, request_id, time.perf_counter(), time.time())
        ex.errors = self._errors
        try:
            await self._handle(ex)
        except Exception as exc:
            # The outermost boundary: a bug must still answer in OpenAI's shape, not 500 text.
            log.exception("unhandled error in %s", self.path)
            self.state.metrics.error("internal_error")
            if not call.started:
                err = GatewayError(f"internal gateway error ({type(exc).__name__})")
                status, headers, body = error_response_parts(err, self._errors)
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _handle(self, ex: Exchange) -> None:
        state = self.state
        try:
            await self._inbound.read(ex)
        except ClientGone:
            state.metrics.disconnect("before_response")
            ex.status, ex.error_code = 499, "client_gone"
            self._outcome.finish(ex, None)
            return
        except GatewayError as err:
            await send_error(ex, err, state.metrics)
            ex.status, ex.error_code = err.status, err.code
            self._outcome.finish(ex, None)
            return
        call = ex.call
        upload = ex.upload
        if upload is None or upload.ended:
            call.watch(ex.receive)
        else:
            # The body's own messages still come through `receive`: watch once they ended.
            upload.on_end = lambda: call.watch(ex.receive)
        tracer = state.tracer
        if tracer is not None:
            self._begin_trace(ex, tracer)
        try:
            if ex.tier is not None and state.tiers is not None:
                await run_tiered(
                    ex, state.tiers, self.endpoint, self._route_and_relay, self._inbound.retier
                )
            else:
                await self._route_and_relay(ex)
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

    def _begin_trace(self, ex: Exchange, tracer: RequestTracer) -> None:
        assert ex.request is not None
        attributes = {
            "kvgate.endpoint": self.endpoint.value,
            "kvgate.request_id": ex.request_id,
            "kvgate.model": ex.request.model,
        }
        trace = ex.trace = tracer.begin(
            ex.headers, ex.traceparent, int(ex.started_at * 1e9), attributes
        )
        ex.headers = trace.forward_headers(ex.headers)

    async def _identify(self, ex: Exchange, request: RouteRequest) -> RouteRequest:
        state = self.state
        placements = state.placements
        if placements is not None:
            request, sticky = await self._sticky(ex, request, placements)
            ex.request = request
            if sticky is not None:
                request = with_sticky(request, sticky)
                ex.request = request
        principal = self._identity.principal(ex)
        if principal is not None:
            self._identity.check_body_priority(ex, principal)
            earlier = ex.body.get("previous_response_id") if ex.body is not None else None
            if isinstance(earlier, str) and not await may_use(state, principal, earlier):
                # Another tenant's answer: as unknown as an id that never existed.
                raise NotFound(
                    f"Response with id '{earlier}' not found.", param="previous_response_id"
                )
        if state.admission is not None:
            request = ex.request = state.admission.classify(
                request, ex.body or {}, ex.scope["headers"]
            )
        if principal is not None:
            request = ex.request = self._identity.narrow(ex, principal, request)
        return request

    async def _sticky(
        self, ex: Exchange, request: RouteRequest, placements: SessionPlacements
    ) -> tuple[RouteRequest, ReplicaId | None]:
        """The request (a Responses continuation is keyed on its chain) and its session's
        replica, or, for a request the client tied to a parent agent or to a Responses
        chain, where that lineage is."""
        previous = ex.chain_root
        if previous is None:
            sticky = await placements.lookup(request.session_key)
            if sticky is None and ex.parent_key is not None:
                # A child agent's first request starts where its parent is.
                sticky = await placements.lookup(ex.parent_key)
                ex.borrowed = sticky is not None
            return request, sticky
        root = await placements.response_root(previous) or previous
        ex.chain_root = root
        # The replica storing the answer it continues; else where its chain is placed.
        owner = await placements.lookup(request.session_key)
        chain = chain_key(root)
        placed = await placements.lookup(chain)
        request = with_key(request, chain, request.key_source)
        if owner is not None and owner in self.state.cluster.members:
            ex.borrowed = owner != placed
            return request, owner
        return request, placed

    async def _route_and_relay(self, ex: Exchange) -> None:
        state = self.state
        assert ex.request is not None
        request = ex.request
        first_byte = FirstByte(state, ex, request)
        try:
            try:
                request = await self._identify(ex, request)
                leg = ex.leg = await self._attempts.open(ex, request)
            except GatewayError as err:
                ex.status, ex.error_code = err.status, err.code
                await send_error(ex, err, state.metrics)
                return
            await self._placed(ex, request, leg.replica)
            # Usage is read for the observers, and for a quota ticket to settle on.
            want_usage = bool(state.observers) or TICKET_KEY in ex.scope or ex.tier is not None
            keep = None
            if ex.find_response_id and state.placements is not None:
                keep = partial(self._keep, ex, leg.replica)
            await relay(ex, leg, state.metrics, want_usage, first_byte.token, keep)
        except OSError:
            # The ASGI server refused a send: the client is gone (transport errors of the
            # upstream arrive as GatewayError, never as OSError).
            ex.call.disconnected = True
        except ClientGone:
            ex.call.disconnected = True  # left while its upload was being forwarded
        finally:
            await self._settle(ex, request, first_byte)

    async def _keep(self, ex: Exchange, replica: ReplicaId, response_id: str) -> None:
        """Record an answer the engine stored, shared before the client sees its id."""
        placements = self.state.placements
        assert placements is not None
        principal = self._identity.principal(ex)
        await remember(placements, response_id, replica, principal, ex.chain_root)
        await placements.share()

    async def _placed(self, ex: Exchange, request: RouteRequest, replica: ReplicaId) -> None:
        state = self.state
        placements = state.placements
        if placements is not None and (request.sticky_replica != replica or ex.borrowed):
            await placements.record(request.session_key, replica)
        # Told at dispatch already unless a PD hand-off serves from another replica.
        place(state, ex, request, replica)

    async def _settle(
        self, ex: Exchange, request: RouteRequest, first_byte: Callable[[], None]
    ) -> None:
        state, call, leg = self.state, ex.call, ex.leg
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
            ex.ok = False
            ex.error_code = ex.error_code or "client_gone"
            if not ex.status:
                ex.status = 499
        self._outcome.finish(ex, replica)
        if ex.trace is not None:
            ex.trace.finish(ex.status, replica, ex.retries, ex.error_code)

    # The stages around the forwarding, for the EPP (gateway.epp), where Envoy forwards.
    identify = _identify
    placed = _placed
    settle = _settle
