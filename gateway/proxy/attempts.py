"""Routing, admission and attempts: choose once, maybe wait, then fail over down the ranking.

`Attempts.open(ex)` returns the `Leg` whose response headers arrived. Retries are declared
once (tenacity): retryable errors only, never the same replica twice, bounded in count and
in time since the first failure. The first attempt runs bare, so the common case pays
nothing for tenacity. `state.dispatcher` (PD) may take over a leg on any attempt.
"""

from __future__ import annotations

import asyncio

from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, stop_after_delay
from tenacity.wait import wait_fixed, wait_none

from gateway.errors import GatewayError, NoHealthyReplica
from gateway.forward import Leg, open_leg
from gateway.hooks import ForwardContext
from gateway.proxy.continuation import KEY_SOURCE
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
        cluster = self._state.cluster
        members = cluster.members
        for replica in choice.ranked:
            if (
                replica not in tried
                and cluster.is_healthy(replica)
                and replica in members
                and (pools is None or members[replica].pool in pools)
            ):
                return replica
        return None

    async def open(self, ex: Exchange, request: RouteRequest) -> Leg:
        """Choose and open a leg to `ex.path` (the route plus the client's query string)."""
        state = self._state
        cluster = state.cluster
        body, raw, headers, path, pools = ex.body or {}, ex.raw, ex.headers, ex.path, ex.pools
        view = cluster.view()
        choice = state.router.choose(request, view)
        pinned = request.sticky_replica
        if request.key_source == KEY_SOURCE and pinned is not None and pinned in cluster.members:
            # The answer it continues is stored on that replica only: no other may serve it
            # (a missing replica leaves the router's choice, and the engine's own 404).
            choice = Choice((pinned,), "previous_response_id", choice.policy)
        state.metrics.decision(choice.policy or type(state.router).__name__, choice.reason)
        gate = state.admission
        if gate is not None:
            target = self._candidate(choice, [], pools)
            if target is not None and gate.must_wait(request, target, view):
                await gate.wait(request, target)
                view = cluster.view()
        tried: list[ReplicaId] = []
        last_error: GatewayError | None = None

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
            if state.router_prefill is not None:
                state.router_prefill.dispatched(request, replica)
            for observe in state.dispatch_observers:
                observe(request, replica, body)
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
            try:
                return await attempt()
            except GatewayError as err:
                if not err.retryable or self._retrying is None:
                    raise
            if self._backoff_s:
                await asyncio.sleep(self._backoff_s)
            async for retry in self._retrying.copy():
                with retry:
                    leg = await attempt()
                    ex.retries = len(tried) - 1
                    return leg
        except _Exhausted:
            assert last_error is not None
            raise last_error from None
        raise AssertionError("unreachable: tenacity either returns or raises")
