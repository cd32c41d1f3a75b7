"""Routing, admission and attempts: choose once, maybe wait, then fail over down the ranking.

`Attempts.open(ex)` returns the `Leg` whose response headers arrived. Before the decision,
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
from gateway.proxy.decide import candidate, decide, mark_placed
from gateway.proxy.exchange import Exchange, RawHeaders
from gateway.state import GatewayState
from gateway.types import Choice, ReplicaId, RouteRequest


class _Exhausted(Exception):
    """Every candidate replica was tried."""


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, GatewayError) and exc.retryable


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

    def _candidate(
        self, choice: Choice, tried: list[ReplicaId], pools: frozenset[str] | None = None
    ) -> ReplicaId | None:
        return candidate(self._state, choice, tried, pools)

    async def open(self, ex: Exchange, request: RouteRequest) -> Leg:
        """Choose and open a leg to `ex.path` (the route plus the client's query string)."""
        state = self._state
        cluster = state.cluster
        body, raw, headers, path, pools = ex.body or {}, ex.raw, ex.headers, ex.path, ex.pools
        upload = ex.upload
        trace = ex.trace
        choice, view = await decide(state, ex, request)
        tried: list[ReplicaId] = []
        last_error: GatewayError | None = None
        shape = state.payload

        async def open_to(
            replica: ReplicaId, payload: bytes, hdrs: RawHeaders | None = None
        ) -> Leg:
            # PD dispatchers wait for a leg's first chunk themselves (commit_first_chunk),
            # racing it against the prefill leg: open_leg must not read it first.
            return await open_leg(
                cluster,
                state.client,
                state.health,
                replica,
                path,
                headers if hdrs is None else hdrs,
                payload,
                peek=False,
            )

        def leg_body(replica: ReplicaId, prefills: bool) -> Mapping[str, Any]:
            return body if shape is None else shape.body(request, body, replica, prefills=prefills)

        def placed_now(replica: ReplicaId) -> None:
            mark_placed(state, ex, request, view, choice, replica)

        async def attempt() -> Leg:
            nonlocal choice, last_error
            replica = self._candidate(choice, tried, pools)
            if replica is None and tried:
                # The ranking is used up: ask again, health may have changed.
                choice = state.router.choose(request, cluster.view())
                replica = self._candidate(choice, tried, pools)
            if replica is None:
                if last_error is not None:
                    raise _Exhausted()
                raise NoHealthyReplica(f"no healthy replica serves model {request.model!r}")
            if tried:
                state.metrics.retry(last_error.code if last_error and last_error.code else "error")
                state.metrics.decision(choice.policy or type(state.router).__name__, "failover")
            tried.append(replica)
            # Before the placement is recorded: what the replica holds, not this request.
            estimate = state.router_cached
            cached = estimate(request, replica) if estimate is not None else 0
            cluster.prefill.dispatched(
                request.request_id, replica, request.prompt_tokens - cached, cluster.clock()
            )
            if state.router_prefill is not None:
                state.router_prefill.dispatched(request, replica)
            for observe in state.dispatch_observers:
                observe(request, replica, body)
            span = trace.upstream(replica, len(tried)) if trace is not None else None
            return await send(replica, span)

        async def send(replica: ReplicaId, span: AttemptSpan | None) -> Leg:
            # One procedure, traced or not: the span (when tracing is on) only adds its
            # context to the headers and marks when the response headers arrived.
            nonlocal last_error
            hdrs = headers if span is None else span.headers(headers)
            on_headers = None if span is None else span.mark_headers
            try:
                if upload is not None:
                    # Forwarded as it is (no priority field to set in a form, nothing for PD).
                    placed_now(replica)
                    leg = await open_leg(
                        cluster,
                        state.client,
                        state.health,
                        replica,
                        path,
                        hdrs,
                        upload,
                        on_headers=on_headers,
                    )
                else:
                    dispatched = None
                    if state.dispatcher is not None:
                        ctx = ForwardContext(
                            request, body, raw, path, hdrs, choice, view, open_to, leg_body
                        )
                        dispatched = await state.dispatcher.dispatch(ctx)
                    if dispatched is not None:
                        leg = dispatched
                    else:
                        payload = raw if shape is None else shape(request, body, raw, replica)
                        placed_now(replica)
                        # Straight to open_leg, not through open_to: one coroutine less.
                        leg = await open_leg(
                            cluster,
                            state.client,
                            state.health,
                            replica,
                            path,
                            hdrs,
                            payload,
                            on_headers=on_headers,
                        )
                if span is not None:
                    span.end(leg.response.status)
                return leg
            except GatewayError as err:
                if upload is not None and upload.failure is err:
                    if span is not None:
                        span.end(None, err.code or "error", err.message)
                    raise  # the client's side of the upload, not the replica's
                last_error = err
                state.metrics.upstream_failure(replica, err.code or "error")
                if span is not None:
                    status = err.upstream_status if isinstance(err, UpstreamStatusError) else None
                    span.end(status, err.code or "error", err.message)
                raise
            finally:
                if span is not None:
                    span.end()  # cancelled: the span still ends (a no-op after the others)

        try:
            try:
                return await attempt()
            except GatewayError as err:
                if (
                    not err.retryable
                    or self._retrying is None
                    or (upload is not None and upload.sent)
                ):
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
                    return await attempt()
        except _Exhausted:
            assert last_error is not None
            raise last_error from None
        finally:
            # Set however the attempts ended: a request that failed on every replica
            # reports its retries too.
            ex.retries = max(len(tried) - 1, 0)
        raise AssertionError("unreachable: tenacity either returns or raises")
