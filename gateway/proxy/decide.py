"""The decision, shared by the proxy (gateway.proxy.attempts) and the EPP (gateway.epp).

Request in, choice out, outcome back: `decide` runs the pre-route wait, the router, the
pinning of a continuation and admission's wait; `dispatched` gives the prefill meter, the
router and the dispatch observers the replica an attempt goes to; `mark_placed` and
`place` tell the router and the lineage index where the request went, once per replica;
`FirstByte` gives admission and the router their prefill signal once. Whoever forwards the bytes (the proxy's legs, or Envoy told by the
EPP) calls these, so no policy, admission or accounting step exists twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from gateway.errors import GatewayError
from gateway.forecast import forecast
from gateway.hooks import RequestSpans
from gateway.proxy.continuation import KEY_SOURCE
from gateway.proxy.exchange import Exchange
from gateway.state import GatewayState
from gateway.types import Choice, ClusterView, ReplicaId, RouteRequest


def candidate(
    state: GatewayState,
    choice: Choice,
    tried: list[ReplicaId],
    pools: frozenset[str] | None = None,
) -> ReplicaId | None:
    """The first replica of the ranking not tried yet, healthy, a member, in `pools`."""
    cluster = state.cluster
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


async def decide(
    state: GatewayState, ex: Exchange, request: RouteRequest
) -> tuple[Choice, ClusterView]:
    """Choose for `request`; may wait (pre-route, admission) and raise admission's 429."""
    cluster = state.cluster
    body, pools = ex.body or {}, ex.pools
    trace = ex.trace
    started_ns = time.time_ns() if trace is not None else 0
    if state.pre_route is not None:
        ready = state.pre_route(request, body)
        if ready is not None:
            await ready
    view = cluster.view()
    choice = state.router.choose(request, view)
    pinned = request.sticky_replica
    if request.key_source == KEY_SOURCE and pinned is not None and pinned in cluster.members:
        # The answer it continues is stored on that replica only: no other may serve it
        # (a missing replica leaves the router's choice, and the engine's own 404).
        choice = Choice((pinned,), "previous_response_id", choice.policy)
    policy = choice.policy or type(state.router).__name__
    state.metrics.decision(policy, choice.reason)
    if trace is not None:
        first = candidate(state, choice, [], pools)
        trace.route(started_ns, policy, choice.reason, first, len(choice.ranked))
    gate = state.admission
    if gate is not None:
        target = candidate(state, choice, [], pools)
        if target is not None and gate.must_wait(request, target, view):
            if trace is None:
                await gate.wait(request, target)
            else:
                await _traced_wait(state, trace, request, target)
            view = cluster.view()
    return choice, view


def dispatched(
    state: GatewayState, request: RouteRequest, replica: ReplicaId, body: Mapping[str, Any]
) -> None:
    """The request is about to go to `replica`: the prefill meter (with what the replica
    holds before this request is placed there), the router's prefill tracking and the
    dispatch observers hear of it."""
    estimate = state.router_cached
    cached = estimate(request, replica) if estimate is not None else 0
    cluster = state.cluster
    cluster.prefill.dispatched(
        request.request_id, replica, request.prompt_tokens - cached, cluster.clock()
    )
    if state.router_prefill is not None:
        state.router_prefill.dispatched(request, replica)
    for observe in state.dispatch_observers:
        observe(request, replica, body)


def mark_placed(
    state: GatewayState,
    ex: Exchange,
    request: RouteRequest,
    view: ClusterView,
    choice: Choice,
    replica: ReplicaId,
) -> None:
    """Placed as the attempt is sent, not once the first byte is back: a request sharing
    this prompt that arrives during its prefill (seconds at 100K tokens) must find it
    placed. After the PD decision, which asks what is cached where."""
    estimate = state.router_cached
    if estimate is not None:
        policy = choice.policy or type(state.router).__name__
        ex.forecast = forecast(estimate, request, replica, choice.ranked, policy)
    place(state, ex, request, replica, view)


def place(
    state: GatewayState,
    ex: Exchange,
    request: RouteRequest,
    replica: ReplicaId,
    view: ClusterView | None = None,
) -> None:
    """Tell the router and the lineage index that `request` is on `replica`, once: at
    dispatch, and again only when the replica serving it is another one (a PD hand-off
    serves from its decode replica)."""
    if ex.placed_on == replica:
        return
    ex.placed_on = replica
    if state.router_placed is not None:
        state.router_placed(request, replica)
    lineage = state.lineage
    if lineage is not None and request.key_source == "lineage":
        lineage.fit((view if view is not None else state.cluster.view()).replicas)
        lineage.record(request.lineage_hashes, request.session_key, request.lineage_tail)


class FirstByte:
    """Prefill signals, once per request: the replica's prefill speed (the cluster's
    prefill meter) from a real first token (`token`), and admission's and the router's
    prefill signal at the first byte or, without one, at the end (a call). The signal names
    the request as identity left it (`ex.request`: sticky replica, class)."""

    __slots__ = (
        "_clock",
        "_ex",
        "_meter",
        "_notify",
        "_observers",
        "_request",
        "_tracker",
        "pending",
    )

    def __init__(self, state: GatewayState, ex: Exchange, request: RouteRequest) -> None:
        self._ex = ex
        self._request = request
        self._meter, self._clock = state.cluster.prefill, state.cluster.clock
        gate = state.admission
        self._notify: Callable[[RouteRequest, ReplicaId | None], None] | None = (
            gate.first_byte if gate is not None else None
        )
        self._tracker = state.router_prefill
        self._observers = state.prefill_observers
        # False when neither admission, the router nor a prefill observer listens.
        self.pending = (
            self._notify is not None or self._tracker is not None or bool(self._observers)
        )

    def token(self) -> None:
        """The first token is back: a prefill-speed sample, then the signals."""
        self._meter.first_token(self._request.request_id, self._clock())
        self()

    def __call__(self) -> None:
        # Ended (or failed) without a first token: the meter takes no sample.
        self._meter.abandoned(self._request.request_id)
        if self.pending:
            self.pending = False
            ex = self._ex
            request = ex.request if ex.request is not None else self._request
            if self._notify is not None:
                self._notify(request, ex.leg.replica if ex.leg is not None else None)
            if self._tracker is not None:
                self._tracker.prefilled(request)
            for observe in self._observers:
                observe(request)


async def _traced_wait(
    state: GatewayState, trace: RequestSpans, request: RouteRequest, target: ReplicaId
) -> None:
    assert state.admission is not None
    started_ns = time.time_ns()
    outcome = "cancelled"
    try:
        await state.admission.wait(request, target)
        outcome = "released"
    except GatewayError as err:
        outcome = err.code or "rejected"
        raise
    finally:
        trace.queued(started_ns, request.priority_class, target, outcome)
