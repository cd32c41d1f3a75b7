"""Stored Responses: `GET /v1/responses/{id}` (`?stream=true&starting_after=N` replays a
background stream), `POST /v1/responses/{id}/cancel`, `DELETE /v1/responses/{id}` and
`GET /v1/responses/{id}/input_items`, each sent to the one replica that stored the answer.

vLLM keeps a response in the memory of the process that made it, so only that replica can
answer. Its owner is the placement recorded when the answer passed through
(gateway.proxy.continuation); with none (the entry aged out, another gateway or worker saw
the answer, the gateway restarted on in-memory placements) and `responses.locate` on, every
healthy replica is asked `GET /v1/responses/{id}` at once and the one answering 200 owns it
(and is recorded). No owner: OpenAI's 404, worded as vLLM words it. Nothing is retried on
another replica: no other one could answer. Whatever the owner says is relayed as it is,
including vLLM's own refusal of routes it does not serve (DELETE and input_items: 405/404).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from urllib.parse import quote

from gateway.asgi import Receive, Scope, Send
from gateway.body import ClientGone, read_body
from gateway.disconnect import CallState
from gateway.errors import GatewayError, NotFound, error_response_parts
from gateway.forward import Leg, open_leg
from gateway.proxy.continuation import may_use, response_key
from gateway.proxy.exchange import Exchange, RawHeaders
from gateway.proxy.inbound import Inbound, declared_length
from gateway.proxy.relay import relay
from gateway.proxy.respond import send_error
from gateway.request_id import RequestIds
from gateway.scope import PRINCIPAL_KEY, REQUEST_ID_KEY
from gateway.state import GatewayState
from gateway.traceparent import TRACEPARENT
from gateway.types import Endpoint, ReplicaId
from gateway.upstream import Timeouts

log = logging.getLogger("kvgate.proxy")

_PREFIX = "/v1/responses/"
# What a locating GET carries of the forwarded headers (credentials, ids, trace context).
_PROBE_HEADERS = frozenset({b"authorization", b"x-request-id", b"traceparent", b"tracestate"})


@dataclass(frozen=True, slots=True)
class StoredRoute:
    """One route on a stored response: `suffix` follows the id; `label`: the metrics'
    `endpoint` label."""

    method: str
    suffix: str
    label: str

    @property
    def path(self) -> str:
        return _PREFIX + "{response_id}" + self.suffix


STORED_ROUTES: tuple[StoredRoute, ...] = (
    StoredRoute("GET", "", "responses_retrieve"),
    StoredRoute("DELETE", "", "responses_delete"),
    StoredRoute("POST", "/cancel", "responses_cancel"),
    StoredRoute("GET", "/input_items", "responses_input_items"),
)


class StoredResponseEndpoint:
    """ASGI app for one `StoredRoute` (mounted as a Starlette route: it reads the id from
    the scope's `path_params`)."""

    def __init__(self, state: GatewayState, route: StoredRoute) -> None:
        self.state = state
        self.route = route
        # Headers and query go to the engine as on POST /v1/responses.
        self._inbound = Inbound(state, Endpoint.RESPONSES, _PREFIX)
        self._new_id = RequestIds()
        probe_s = state.settings.timeouts.probe_s
        self._probe_timeouts = Timeouts(probe_s, probe_s, probe_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = CallState(asyncio.current_task())
        request_id: str = scope.get(REQUEST_ID_KEY) or self._new_id()
        ex = Exchange(scope, receive, send, call, request_id, time.perf_counter(), time.time())
        try:
            await self._handle(ex)
        except Exception as exc:
            log.exception("unhandled error in %s %s", self.route.method, self.route.path)
            self.state.metrics.error("internal_error")
            if not call.started:
                err = GatewayError(f"internal gateway error ({type(exc).__name__})")
                status, headers, body = error_response_parts(err)
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _handle(self, ex: Exchange) -> None:
        state, call = self.state, ex.call
        leg: Leg | None = None
        try:
            try:
                leg = ex.leg = await self._open(ex)
            except GatewayError as err:
                ex.status, ex.error_code = err.status, err.code
                await send_error(ex, err, state.metrics)
                return
            await relay(ex, leg, state.metrics, False)
        except (ClientGone, OSError):
            call.disconnected = True  # left before or while the answer went out
        except asyncio.CancelledError:
            if not call.disconnected:
                raise
            task = call.task
            if task is not None:
                task.uncancel()
        finally:
            call.active = False
            call.close_watcher()
            if leg is not None:
                await leg.aclose()
            if call.disconnected:
                state.metrics.disconnect("mid_stream" if call.started else "before_response")
                ex.status = ex.status or 499
            latency = time.perf_counter() - ex.t0
            ttfb = call.ttfb - ex.t0 if call.ttfb is not None else None
            replica = leg.replica if leg is not None else ""
            state.metrics.request_done(self.route.label, replica, ex.status, False, latency, ttfb)

    async def _open(self, ex: Exchange) -> Leg:
        state, scope = self.state, ex.scope
        content_length = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                content_length = value
            elif name == TRACEPARENT:
                ex.traceparent = value
        limit = state.settings.limits.max_body_bytes
        raw = await read_body(ex.receive, limit, declared_length(content_length))
        response_id: str = scope["path_params"]["response_id"]
        path = _PREFIX + quote(response_id, safe="") + self.route.suffix
        self._inbound.forward_headers(ex, scope, path)
        if not await may_use(state, scope.get(PRINCIPAL_KEY), response_id):
            # Another tenant's: 404, as for an id that never existed (no existence oracle).
            raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")
        owner = await self._owner(response_id, ex.headers)
        if owner is None:
            raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")
        ex.call.watch(ex.receive)
        cluster = state.cluster
        body = raw if raw or self.route.method == "POST" else None
        return await open_leg(
            cluster,
            state.client,
            state.health,
            owner,
            ex.path,
            ex.headers,
            body,
            peek=False,
            method=self.route.method,
        )

    async def _owner(self, response_id: str, headers: RawHeaders) -> ReplicaId | None:
        state = self.state
        key = response_key(response_id)
        placements = state.placements
        if placements is not None:
            owner = await placements.lookup(key)
            if owner is not None and owner in state.cluster.members:
                return owner
        if not state.settings.responses.locate:
            return None
        owner = await self._locate(response_id, [h for h in headers if h[0] in _PROBE_HEADERS])
        if owner is not None and placements is not None:
            await placements.record(key, owner)
        return owner

    async def _locate(self, response_id: str, headers: RawHeaders) -> ReplicaId | None:
        """The healthy replica that answers 200 for the id, asking all of them at once."""
        cluster = self.state.cluster
        path = _PREFIX + quote(response_id, safe="")
        asks = {
            asyncio.ensure_future(self._holds(replica, path, headers)): replica
            for replica in cluster.members
            if cluster.is_healthy(replica)
        }
        try:
            for done in asyncio.as_completed(asks):
                replica = await done
                if replica is not None:
                    return replica
            return None
        finally:
            for ask in asks:
                ask.cancel()
            await asyncio.gather(*asks, return_exceptions=True)

    async def _holds(self, replica: ReplicaId, path: str, headers: RawHeaders) -> ReplicaId | None:
        state = self.state
        url = state.cluster.url_of(replica) + path
        try:
            response = await state.client.send(
                "GET", url, headers, None, timeouts=self._probe_timeouts
            )
            try:
                status = response.status
                if status == 200:
                    await response.read()  # small; read, so the connection is reused
            finally:
                await response.aclose()
        except GatewayError as err:
            log.debug("locating a response: replica %s did not answer: %s", replica, err)
            return None
        return replica if status == 200 else None
