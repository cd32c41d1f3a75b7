"""Builds the router the proxy calls: filters, then a scoring policy, then a fallback.

The composition is itself a `Policy`, so the proxy, the simulator and tests treat a
composed router exactly like a single policy. It also forwards the optional abilities
(`placed`, `finished`, `membership_changed`) to whichever parts have them.

Filters run in configured order:

* ``healthy`` and ``serves_model`` drop candidates;
* ``not_saturated`` demotes: the scorer's ranking is stably partitioned so saturated
  replicas (unknown or stale load counts as saturated) come after every fresh one. They
  stay in the list so failover still has somewhere to go, and when all are saturated the
  scorer's order stands. Admission control, not routing, decides to queue or refuse.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.errors import ConfigError
from gateway.policy import (
    DEFAULT_POLICY,
    EstimatesCachedTokens,
    ObservesOutcome,
    ObservesPlacement,
    Policy,
    PolicyConfig,
    PolicyContext,
    ReactsToMembership,
    TracksPrefill,
    build_policy,
    resolve_policy_class,
    weighs_saturation,
)
from gateway.same_prompt import DEFAULT_SAME_PROMPT_WAIT_S
from gateway.types import Choice, ClusterView, EngineLoad, ReplicaId, ReplicaState, RouteRequest

# A drop filter may look at the request's model only: its result is cached per model.
DropFilter = Callable[[RouteRequest, ReplicaState], bool]

# Registries are data: filter name -> predicate (True keeps the replica).
DROP_FILTERS: Mapping[str, DropFilter] = MappingProxyType(
    {
        "healthy": lambda request, replica: replica.healthy,
        "serves_model": lambda request, replica: replica.serves(request.model),
    }
)
DEMOTE_FILTERS = frozenset({"not_saturated"})
# Saturated replicas are moved behind this many fresh ones: deeper than any retry budget.
FAILOVER_DEPTH = 16


class SaturationLimits(BaseModel):
    """When a replica counts as saturated; unknown (absent or stale) load always does."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_waiting: float = Field(
        default=16.0, gt=0, description="engine queue length counted as full"
    )
    max_kv_usage: float = Field(
        default=0.98, gt=0, le=1.0, description="KV usage fraction counted as full (with a queue)"
    )


def is_saturated(load: EngineLoad | None, limits: SaturationLimits) -> bool:
    if load is None:
        return True
    if load.waiting >= limits.max_waiting:
        return True
    return load.kv_usage is not None and load.kv_usage >= limits.max_kv_usage and load.waiting > 0


def known_filter_names() -> list[str]:
    return sorted({*DROP_FILTERS, *DEMOTE_FILTERS})


class RoutingSettings(BaseModel):
    """`routing:` section. `policies.<name>` holds each policy's own config."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: str = Field(default=DEFAULT_POLICY, description="routing policy name or module:Class")
    fallback: str | None = Field(
        default=None, description="policy used when the main one ranks nothing"
    )
    filters: tuple[str, ...] = Field(
        default=("healthy", "serves_model", "not_saturated"),
        description="candidate filters, in order",
    )
    saturation: SaturationLimits = Field(
        default_factory=SaturationLimits, description="limits of the not_saturated filter"
    )
    policies: dict[str, dict[str, Any]] = Field(default_factory=dict)
    same_prompt_wait_s: float = Field(
        default=DEFAULT_SAME_PROMPT_WAIT_S,
        ge=0.0,
        description="a request repeating a prompt of its conversation that is still in "
        "prefill waits for that copy's first token, at most the copy's expected prefill "
        "time and at most this long; 0 sends every copy at once (gateway.same_prompt)",
    )


class ComposedRouter:
    """Filters -> scorer -> fallback, behaving as one `Policy`.

    Cost: O(n) filtering plus the parts' own cost; a sub-view is built only when a filter
    actually removed or demoted a replica.
    """

    name: ClassVar[str] = "router"
    cached_tokens: Callable[[RouteRequest, ReplicaId], int]

    def __init__(
        self,
        scorer: Policy,
        fallback: Policy | None = None,
        *,
        filters: Sequence[str] = (),
        saturation: SaturationLimits | None = None,
    ) -> None:
        unknown = [f for f in filters if f not in DROP_FILTERS and f not in DEMOTE_FILTERS]
        if unknown:
            raise ConfigError(
                f"unknown routing filter(s) {unknown}; known filters: "
                + ", ".join(known_filter_names()),
                param="routing.filters",
            )
        self.scorer = scorer
        self.fallback = fallback
        self._drop = tuple(DROP_FILTERS[f] for f in filters if f in DROP_FILTERS)
        # A scorer that weighs saturation itself (its own load bound) is not second-guessed.
        self._demote = "not_saturated" in filters and not weighs_saturation(scorer)
        self._limits = saturation or SaturationLimits()
        self._narrow_source: tuple[ReplicaState, ...] | None = None
        self._narrowed: dict[
            str, tuple[tuple[ReplicaState, ...], Mapping[ReplicaId, ReplicaState]]
        ] = {}
        parts = [p for p in (scorer, fallback) if p is not None]
        # Abilities are detected once here, never probed per request.
        self._placement = [p for p in parts if isinstance(p, ObservesPlacement)]
        self._outcome = [p for p in parts if isinstance(p, ObservesOutcome)]
        self._membership = [p for p in parts if isinstance(p, ReactsToMembership)]
        self._prefill = [p for p in parts if isinstance(p, TracksPrefill)]
        estimators = [p for p in parts if isinstance(p, EstimatesCachedTokens)]
        if estimators:
            # Set only when a part has it, so `isinstance(router, EstimatesCachedTokens)`
            # stays false otherwise (PD then falls back to its own served-prefix index).
            self.cached_tokens = estimators[0].cached_tokens

    def parts(self) -> tuple[Policy, ...]:
        """`Composite`: the scorer, then the fallback."""
        return (self.scorer,) if self.fallback is None else (self.scorer, self.fallback)

    def choose(self, request: RouteRequest, view: ClusterView) -> Choice:
        sub = self._narrow(request, view)
        if not sub.replicas:
            return Choice((), "no_candidates", self.name)
        choice = self.scorer.choose(request, sub)
        if not choice.ranked and self.fallback is not None:
            choice = self.fallback.choose(request, sub)
        if not self._demote or len(choice.ranked) < 2:
            return choice
        # Stable partition: the scorer's order is kept within "fresh" and "saturated". Only
        # the head that failover can reach is partitioned, so the cost stays O(depth).
        by_id, limits = sub.by_id, self._limits
        fresh: list[ReplicaId] = []
        saturated: list[ReplicaId] = []
        ranked = choice.ranked
        rest: tuple[ReplicaId, ...] = ()
        for i, rid in enumerate(ranked):
            replica = by_id.get(rid)
            if replica is None or is_saturated(sub.load_of(replica), limits):
                saturated.append(rid)
            else:
                fresh.append(rid)
                if len(fresh) >= FAILOVER_DEPTH:
                    rest = ranked[i + 1 :]
                    break
        if not fresh or not saturated or ranked[: len(fresh)] == tuple(fresh):
            return choice  # nothing to move
        return Choice(tuple(fresh + saturated) + rest, choice.reason, choice.policy)

    def _narrow(self, request: RouteRequest, view: ClusterView) -> ClusterView:
        """The view restricted by the drop filters, reusing one replica tuple per snapshot
        and model so that policies caching on `view.replicas` identity stay O(1)."""
        if not self._drop:
            return view
        if view.replicas is not self._narrow_source:
            self._narrow_source = view.replicas
            self._narrowed.clear()
        cached = self._narrowed.get(request.model)
        if cached is None:
            kept = tuple(r for r in view.replicas if all(k(request, r) for k in self._drop))
            if len(kept) == len(view.replicas):
                cached = (view.replicas, view.by_id)
            else:
                cached = (kept, MappingProxyType({r.id: r for r in kept}))
            self._narrowed[request.model] = cached
        replicas, by_id = cached
        if replicas is view.replicas:
            return view
        return ClusterView(
            replicas,
            view.now,
            view.stale_after,
            view.in_flight,
            by_id,
            view.cache_evidence,
            view.prefill,
        )

    def placed(self, request: RouteRequest, replica: ReplicaId) -> None:
        for part in self._placement:
            part.placed(request, replica)

    def finished(
        self, request: RouteRequest, replica: ReplicaId, ok: bool, latency_s: float
    ) -> None:
        for part in self._outcome:
            part.finished(request, replica, ok, latency_s)

    def membership_changed(self, replicas: Sequence[ReplicaState]) -> None:
        for part in self._membership:
            part.membership_changed(replicas)

    def dispatched(self, request: RouteRequest, replica: ReplicaId) -> None:
        for part in self._prefill:
            part.dispatched(request, replica)

    def prefilled(self, request: RouteRequest) -> None:
        for part in self._prefill:
            part.prefilled(request)


def validate_policy_sections(settings: RoutingSettings) -> None:
    """Every configured policy name and `policies.<name>` section must resolve and validate."""
    names = [settings.policy, *([settings.fallback] if settings.fallback else [])]
    for name in [*names, *settings.policies]:
        cls = resolve_policy_class(name)
        config_cls: type[PolicyConfig] = getattr(cls, "Config", PolicyConfig)
        try:
            config_cls.model_validate(settings.policies.get(name) or {})
        except ValidationError as exc:
            raise ConfigError(
                f"invalid config for policy {name!r}: {exc}", param=f"routing.policies.{name}"
            ) from exc


def build_router(settings: RoutingSettings, context: PolicyContext) -> Policy:
    """Resolve, validate and compose the configured policies (fails fast at start-up)."""
    validate_policy_sections(settings)
    scorer = build_policy(settings.policy, settings.policies.get(settings.policy), context)
    fallback = (
        build_policy(settings.fallback, settings.policies.get(settings.fallback), context)
        if settings.fallback
        else None
    )
    return ComposedRouter(
        scorer, fallback, filters=settings.filters, saturation=settings.saturation
    )
