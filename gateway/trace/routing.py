"""Trace requests as the policies see them, and a policy driver with no HTTP.

`kvgate trace stats` and `kvgate simulate` run the real routing code (gateway.routing's
`build_router`) on `RouteRequest`s and `ClusterView`s built here, so a policy is judged
by the same code the proxy runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from gateway.admission.config import EnginePrioritySettings
from gateway.admission.engine_order import EnginePayload
from gateway.lineage import Conversations
from gateway.policy import (
    EstimatesCachedTokens,
    ObservesOutcome,
    ObservesPlacement,
    Policy,
    PolicyContext,
    TracksPrefill,
)
from gateway.prefill_meter import PrefillMeter
from gateway.routing import RoutingSettings, build_router
from gateway.trace.format import TraceRecord
from gateway.types import ClusterView, ReplicaId, ReplicaState, RouteRequest, SessionKey

DEFAULT_MODEL = "kvgate-sim"


def session_key_for(rec: TraceRecord, index: int) -> SessionKey:
    """The session id when the trace has one, else the first block's hash.

    Chained hashes make the first block's hash stand for "this conversation's opening",
    which is what the gateway keys on when a client sends no session id.
    """
    if rec.session_id:
        return SessionKey(rec.session_id)
    if rec.block_hashes:
        return SessionKey(f"{rec.block_hashes[0]:x}")
    return SessionKey(f"req-{index}")


def route_request_for(
    rec: TraceRecord,
    index: int,
    block_tokens: int,
    model: str = DEFAULT_MODEL,
    *,
    sessions: bool = True,
) -> RouteRequest:
    """The request as the proxy would build it. `sessions=False` drops the trace's session
    ids (a client sending no session header). Only full blocks are hashed, as the gateway
    and the engines do."""
    hashes = rec.block_hashes
    if hashes and rec.last_block_tokens < block_tokens:
        hashes = hashes[:-1]
    with_id = sessions and rec.session_id
    plain = (
        rec
        if with_id
        else TraceRecord(
            rec.arrival_s,
            rec.input_tokens,
            rec.output_tokens,
            rec.block_hashes,
            rec.last_block_tokens,
        )
    )
    return RouteRequest(
        request_id=f"trace-{index}",
        model=model,
        session_key=session_key_for(plain, index),
        key_source="session" if with_id else "conversation",
        prefix_hashes=hashes,
        block_tokens=block_tokens,
        prompt_tokens=rec.input_tokens,
        max_tokens=rec.output_tokens,
        stream=True,
    )


def make_replicas(count: int, model: str = DEFAULT_MODEL) -> tuple[ReplicaState, ...]:
    return tuple(
        ReplicaState(id=ReplicaId(f"r{i}"), url=f"sim://r{i}", models=frozenset({model}))
        for i in range(count)
    )


class PolicyDriver:
    """One router plus the bookkeeping the proxy would do around it."""

    def __init__(
        self,
        policy: str,
        replicas: Sequence[ReplicaState],
        policy_config: Mapping[str, Any] | None = None,
        seed: int = 0,
        *,
        lineage: bool = True,
        block_tokens: int = 512,
        engine_priority: EnginePrioritySettings | None = None,
    ) -> None:
        settings = RoutingSettings(policy=policy, policies={policy: dict(policy_config or {})})
        # The proxy's lineage rule, for requests without a session id (gateway.lineage).
        self.conversations = Conversations(block_tokens) if lineage else None
        self.replicas = tuple(replicas)
        self.router: Policy = build_router(
            settings, PolicyContext(replicas=self.replicas, seed=seed)
        )
        # Abilities are detected once, as the proxy does.
        self._placed = self.router if isinstance(self.router, ObservesPlacement) else None
        self._finished = self.router if isinstance(self.router, ObservesOutcome) else None
        self._prefill = self.router if isinstance(self.router, TracksPrefill) else None
        self._cached = (
            self.router.cached_tokens if isinstance(self.router, EstimatesCachedTokens) else None
        )
        # Queued prefill and measured speed per replica, as the proxy keeps them; views
        # built with `now` from the simulator's clock carry it.
        self.meter = PrefillMeter()
        self._order = (
            None
            if engine_priority is None or not engine_priority.shortest_prefill_first
            else EnginePayload(engine_priority, frozenset(), cache=self.router)
        )
        self.unrouted = 0

    def resolve(self, request: RouteRequest) -> RouteRequest:
        """The request keyed on its lineage when it carries no session id."""
        convs = self.conversations
        if convs is None or request.key_source != "conversation":
            return request
        # A trace request has no opening messages to name it by: the lineage hash does.
        key = convs.key_for(request.prefix_hashes, None)
        return request if key is None else replace(request, session_key=key, key_source="lineage")

    def choose(self, request: RouteRequest, view: ClusterView) -> ReplicaId:
        """The first-ranked replica; the first replica when the policy ranks nothing.

        `request` should come from `resolve`; the prompt is entered in the lineage index,
        and the router is told of the dispatch and the placement, as the proxy does.
        """
        return self.dispatch(request, view)[0]

    def dispatch(self, request: RouteRequest, view: ClusterView) -> tuple[ReplicaId, int]:
        """`choose`, and the `priority` the proxy would send a priority-scheduling engine
        (gateway.admission.engine_order; 0 without `engine_priority`), taken before the
        placement is recorded, as the proxy does."""
        choice = self.router.choose(request, view)
        replica = choice.first
        if replica is None:
            self.unrouted += 1
            replica = self.replicas[0].id
        priority = 0 if self._order is None else self._order.rank(request, replica)
        cached = self._cached(request, replica) if self._cached is not None else 0
        self.meter.dispatched(request.request_id, replica, request.prompt_tokens - cached, view.now)
        if self._prefill is not None:
            self._prefill.dispatched(request, replica)
        if self._placed is not None:
            self._placed.placed(request, replica)
        if self.conversations is not None and request.key_source == "lineage":
            self.conversations.record(request.prefix_hashes, request.session_key)
        return replica, priority

    def prefilled(self, request: RouteRequest, now: float | None = None) -> None:
        """The first token is back at `now` (None: no timing, the prefill just ends)."""
        if now is None:
            self.meter.abandoned(request.request_id)
        else:
            self.meter.first_token(request.request_id, now)
        if self._prefill is not None:
            self._prefill.prefilled(request)

    def finished(
        self, request: RouteRequest, replica: ReplicaId, ok: bool, latency_s: float
    ) -> None:
        self.meter.abandoned(request.request_id)
        if self._finished is not None:
            self._finished.finished(request, replica, ok, latency_s)
