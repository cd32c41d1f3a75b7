"""Routing, admission and attempts: choose once, maybe wait, then fail over down the ranking.

`Attempts.open(ex)` returns the `Leg` whose response headers arrived, in three steps:
decide (gateway.proxy.decide), send (one attempt to one replica, traced or not: a span,
when tracing is on, is passed through the same path) and retry (down the ranking). Before the decision,
`state.pre_route` (when a feature set it) may make the request wait a bounded time for
what the decision needs (KV cache events: the prompt's token blocks). Retries are declared
once (tenacity): retryable errors only, never the same replica twice, bounded in count and
in time since the first failure, and for a streamed upload only while none of its bytes
went out (a refused connection, a busy pool). The first attempt runs bare, so the common case pays
nothing for tenacity. `state.dispatcher` (PD) may take over a leg on any attempt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, stop_after_delay
from tenacity.wait import wait_fixed, wait_none

from gateway.errors import GatewayError, NoHealthyReplica, UpstreamStatusError
from gateway.forward import Leg, open_leg
from gateway.hooks import AttemptSpan, ForwardContext
from gateway.proxy.decide import candidate, decide, dispatched, mark_placed
from gateway.proxy.exchange import Exchange, RawHeaders
from gateway.state import GatewayState
from gateway.types import Choice, ClusterView, ReplicaId, RouteRequest
from gateway.upload import Upload


class _Exhausted(Exception):
    """Every candidate replica was tried."""


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, GatewayError) and exc.retryable


class _Walk:
    """One request's way down the ranking: what was decided, which replicas were tried,
    the last replica's error. A slotted plain object, one per request."""

    __slots__ = ("choice", "ex", "last_error", "request", "state", "tried", "view")

    def __init__(
        self,
        state: GatewayState,
        ex: Exchange,
        request: RouteRequest,
        choice: Choice,
        view: ClusterView,
    ) -> None:
        self.state = state
        self.ex = ex
        self.request = request
        self.choice = choice
        self.view = view
        self.tried: list[ReplicaId] = []
        self.last_error: GatewayError | None = None

    def next_replica(self) -> ReplicaId:
        """The next replica to try; counts a failover; `_Exhausted` after the last one."""
        state, request, tried = self.state, self.request, self.tried
        pools = self.ex.pools
        replica = candidate(state, self.choice, tried, pools)
        if replica is None and tried:
            # The ranking is used up: ask again, health may have changed.
            self.choice = state.router.choose(request, state.cluster.view())
            replica = candidate(state, self.choice, tried, pools)
        if replica is None:
            if self.last_error is not None:
                raise _Exhausted()
            raise NoHealthyReplica(f"no healthy replica serves model {request.model!r}")
        if tried:
            last = self.last_error
            state.metrics.retry(last.code if last is not None and last.code else "error")
            policy = self.choice.policy or type(state.router).__name__
            state.metrics.decision(policy, "failover")
        tried.append(replica)
        return replica

    def placed(self, replica: ReplicaId) -> None:
        mark_placed(self.state, self.ex, self.request, self.view, self.choice, replica)

    # For dispatchers (ForwardContext), which build their own legs.
    async def open_to(
        self, replica: ReplicaId, payload: bytes, hdrs: RawHeaders | None = None
    ) -> Leg:
        # PD dispatchers wait for a leg's first chunk themselves (commit_first_chunk),
        # racing it against the prefill leg: open_leg must not read it first.
        state, ex = self.state, self.ex
        return await open_leg(
            state.cluster,
            state.client,
            state.health,
            replica,
            ex.path,
            ex.headers if hdrs is None else hdrs,
            payload,
            peek=False,
        )

    def leg_body(self, replica: ReplicaId, prefills: bool) -> Mapping[str, Any]:
        body = self.ex.body or {}
        shape = self.state.payload
        return body if shape is None else shape.body(self.request, body, replica, prefills=prefills)


class Attempts:
    __slots__ = ("_backoff_s", "_retrying", "_state")

    def __init__(self, state: GatewayState) -> None:
        self._state = state
        retries = state.settings.retries
        self._backoff_s = retries.backoff_s
        # Attempts after the first, bounded in count and in time since the first failure.
        self._retrying: AsyncRetrying | None = None
        if retries.max_attempts > 1:
            self._retrying = AsyncRetrying(
                stop=stop_after_attempt(retries.max_attempts - 1)
                | stop_after_delay(retries.budget_s),
                retry=retry_if_exception(_retryable),
                wait=wait_fixed(retries.backoff_s) if retries.backoff_s else wait_none(),
                reraise=True,
            )

    async def open(self, ex: Exchange, request: RouteRequest) -> Leg:
        """Choose and open a leg to `ex.path` (the route plus the client's query string)."""
        choice, view = await decide(self._state, ex, request)
        walk = _Walk(self._state, ex, request, choice, view)
        try:
            return await self._retry(walk)
        except _Exhausted:
            assert walk.last_error is not None
            raise walk.last_error from None
        finally:
            # Set however the attempts ended: a request that failed on every replica
            # reports its retries too.
            ex.retries = max(len(walk.tried) - 1, 0)

    async def _retry(self, walk: _Walk) -> Leg:
        """The first attempt bare (the common case pays nothing for tenacity), then
        tenacity's bounded failover for retryable errors."""
        upload = walk.ex.upload
        try:
            return await self._attempt(walk)
        except GatewayError as err:
            if not err.retryable or self._retrying is None or (upload is not None and upload.sent):
                raise
        if self._backoff_s:
            await asyncio.sleep(self._backoff_s)
        retrying = self._retrying.copy()
        if upload is not None:
            # A streamed body cannot be sent again once a byte of it went out.
            retrying = self._retrying.copy(
                retry=retry_if_exception(lambda e: _retryable(e) and not upload.sent)
            )
        async for retry in retrying:
            with retry:
                return await self._attempt(walk)
        raise AssertionError("unreachable: tenacity either returns or raises")

    async def _attempt(self, walk: _Walk) -> Leg:
        replica = walk.next_replica()
        ex = walk.ex
        dispatched(self._state, walk.request, replica, ex.body or {})
        trace = ex.trace
        span = trace.upstream(replica, len(walk.tried)) if trace is not None else None
        return await self._send(walk, replica, span)

    async def _send(self, walk: _Walk, replica: ReplicaId, span: AttemptSpan | None) -> Leg:
        """One attempt to `replica`, until its response headers arrived. One procedure,
        traced or not: the span (when tracing is on) only adds its context to the headers
        and marks when the response headers arrived."""
        state, ex, request = self._state, walk.ex, walk.request
        upload = ex.upload
        hdrs = ex.headers if span is None else span.headers(ex.headers)
        on_headers = None if span is None else span.mark_headers
        try:
            payload: bytes | Upload
            if upload is not None:
                # Forwarded as it is (no priority field to set in a form, nothing for PD).
                payload = upload
            else:
                body = ex.body or {}
                if state.dispatcher is not None:
                    ctx = ForwardContext(
                        request,
                        body,
                        ex.raw,
                        ex.path,
                        hdrs,
                        walk.choice,
                        walk.view,
                        walk.open_to,
                        walk.leg_body,
                    )
                    leg = await state.dispatcher.dispatch(ctx)
                    if leg is not None:
                        ex.reached = True
                        if span is not None:
                            span.end(leg.response.status)
                        return leg
                shape = state.payload
                payload = ex.raw if shape is None else shape(request, body, ex.raw, replica)
            walk.placed(replica)
            leg = await open_leg(
                state.cluster,
                state.client,
                state.health,
                replica,
                ex.path,
                hdrs,
                payload,
                on_headers=on_headers,
            )
            ex.reached = True
            if span is not None:
                span.end(leg.response.status)
            return leg
        except GatewayError as err:
            if upload is not None and upload.failure is err:
                if span is not None:
                    span.end(None, err.code or "error", err.message)
                raise  # the client's side of the upload, not the replica's
            if not err.retryable:
                # A failure judged unsafe to send again (a timeout, a reply too large):
                # the engine may have worked on it. A retryable one did nothing there.
                ex.reached = True
            walk.last_error = err
            state.metrics.upstream_failure(replica, err.code or "error")
            if span is not None:
                status = err.upstream_status if isinstance(err, UpstreamStatusError) else None
                span.end(status, err.code or "error", err.message)
            raise
        finally:
            if span is not None:
                span.end()  # cancelled: the span still ends (a no-op after the others)
