"""A policy as a third-party package would ship it, loaded via `module:Class` in tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from gateway.policy import PolicyConfig, PolicyContext
from gateway.types import Choice, ClusterView, ReplicaId, ReplicaState, RouteRequest


class ReverseConfig(PolicyConfig):
    label: str = "reverse"


class Reverse:
    """Ranks replicas in reverse id order and remembers what it was told."""

    name: ClassVar[str] = "reverse"
    Config: ClassVar[type[ReverseConfig]] = ReverseConfig

    def __init__(self, config: ReverseConfig, context: PolicyContext) -> None:
        self.config = config
        self.placements: list[tuple[str, ReplicaId]] = []
        self.memberships: list[int] = []

    def choose(self, request: RouteRequest, view: ClusterView) -> Choice:
        ids = sorted((r.id for r in view.replicas), reverse=True)
        return Choice(tuple(ids), self.config.label, self.name)

    def placed(self, request: RouteRequest, replica: ReplicaId) -> None:
        self.placements.append((request.request_id, replica))

    def membership_changed(self, replicas: Sequence[ReplicaState]) -> None:
        self.memberships.append(len(replicas))


class NothingConfig(PolicyConfig):
    pass


class Nothing:
    """Ranks nothing, so the router's fallback must answer."""

    name: ClassVar[str] = "nothing"
    Config: ClassVar[type[NothingConfig]] = NothingConfig

    def __init__(self, config: NothingConfig, context: PolicyContext) -> None:
        pass

    def choose(self, request: RouteRequest, view: ClusterView) -> Choice:
        return Choice((), "no opinion", self.name)
