"""Trace requests as the policies see them, and a policy driver with no HTTP.

`kvgate trace stats` and `kvgate simulate` run the real routing code (gateway.routing's
`build_router`) on `RouteRequest`s and `ClusterView`s built here, so a policy is judged
by the same code the proxy runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.policy import ObservesOutcome, ObservesPlacement, Policy, PolicyContext
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
    rec: TraceRecord, index: int, block_tokens: int, model: str = DEFAULT_MODEL
) -> RouteRequest:
    return RouteRequest(
        request_id=f"trace-{index}",
        model=model,
        session_key=session_key_for(rec, index),
        key_source="session" if rec.session_id else "conversation",
        prefix_hashes=rec.block_hashes,
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
    ) -> None:
        settings = RoutingSettings(policy=policy, policies={policy: dict(policy_config or {})})
        self.replicas = tuple(replicas)
        self.router: Policy = build_router(
            settings, PolicyContext(replicas=self.replicas, seed=seed)
        )
        # Abilities are detected once, as the proxy does.
        self._placed = self.router if isinstance(self.router, ObservesPlacement) else None
        self._finished = self.router if isinstance(self.router, ObservesOutcome) else None
        self.unrouted = 0

    def choose(self, request: RouteRequest, view: ClusterView) -> ReplicaId:
        """The first-ranked replica; the first replica when the policy ranks nothing."""
        choice = self.router.choose(request, view)
        replica = choice.first
        if replica is None:
            self.unrouted += 1
            replica = self.replicas[0].id
        if self._placed is not None:
            self._placed.placed(request, replica)
        return replica

    def finished(
        self, request: RouteRequest, replica: ReplicaId, ok: bool, latency_s: float
    ) -> None:
        if self._finished is not None:
            self._finished.finished(request, replica, ok, latency_s)
