"""Round-robin over the healthy replicas that serve the model.

Complexity: O(N log N) per request for N replicas (candidates are ordered by id, so the
rotation never depends on the order replicas were listed in).
"""

from __future__ import annotations

from typing import ClassVar

from gateway.policy import PolicyConfig, PolicyContext
from gateway.types import Choice, ClusterView, ReplicaId, RouteRequest


class RoundRobinConfig(PolicyConfig):
    """Round robin has no knobs."""


class RoundRobin:
    """Each request starts one step further along the id-ordered candidate list."""

    name: ClassVar[str] = "round_robin"
    Config: ClassVar[type[PolicyConfig]] = RoundRobinConfig

    def __init__(self, config: PolicyConfig, context: PolicyContext) -> None:
        self.config = config
        self._next = context.seed

    def choose(self, request: RouteRequest, view: ClusterView) -> Choice:
        model = request.model
        candidates = sorted(r.id for r in view.replicas if r.healthy and r.serves(model))
        if not candidates:
            return Choice((), "no_candidates", self.name)
        start = self._next % len(candidates)
        self._next += 1
        ranked: tuple[ReplicaId, ...] = tuple(candidates[start:] + candidates[:start])
        return Choice(ranked, "rotation", self.name)
