"""The routing-policy contract and the registry that resolves policies by name.

A policy is a small synchronous object: `choose(request, view) -> Choice`. It holds its
own frozen pydantic config and may keep private state that it updates through the optional
abilities below (never through I/O). The same object runs in the live proxy, the offline
simulator and unit tests.

Resolution order for a name: built-ins, then the `kvgate.policies` entry-points group,
then a literal `module:Class`. Resolution happens once, at start-up.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, ClassVar, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, ValidationError

from gateway.errors import ConfigError
from gateway.types import Choice, ClusterView, ReplicaId, ReplicaState, RouteRequest

ENTRY_POINT_GROUP = "kvgate.policies"

# Name -> import string. Data, not imports: nothing is loaded until a name is asked for.
BUILTIN_POLICIES: dict[str, str] = {
    "round_robin": "plugins.round_robin:RoundRobin",
    "consistent_hash": "plugins.consistent_hash:ConsistentHash",
    "least_load": "plugins.least_load:LeastLoad",
    "prefix_affinity": "plugins.prefix_affinity:PrefixAffinity",
    "lineage": "plugins.lineage:Lineage",
    "cache_aware": "plugins.cache_aware:CacheAware",
    "cost": "plugins.cost:Cost",
}
DEFAULT_POLICY = "lineage"


# How deep a policy must rank: a `Choice.ranked` may stop after this many replicas (the
# failover head; retries.max_attempts is at most 16 and the proxy asks the router again when
# a ranking is used up). Policies rank everyone when the candidates are this few.
RANK_DEPTH = 16


class PolicyConfig(BaseModel):
    """Base for every policy's config section: frozen, unknown keys rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")


@runtime_checkable
class Policy(Protocol):
    """Ranks replicas for one request. Must not block, await or do I/O."""

    name: ClassVar[str]

    def choose(self, request: RouteRequest, view: ClusterView) -> Choice: ...


@runtime_checkable
class ObservesPlacement(Protocol):
    """Told where a request was actually sent (after retries), e.g. to index its prefix."""

    def placed(self, request: RouteRequest, replica: ReplicaId) -> None: ...


@runtime_checkable
class ObservesOutcome(Protocol):
    """Told how a request ended, e.g. for latency-tracking policies."""

    def finished(
        self, request: RouteRequest, replica: ReplicaId, ok: bool, latency_s: float
    ) -> None: ...


@runtime_checkable
class ReactsToMembership(Protocol):
    """Told when the replica set changes (add/remove/weight), e.g. to rebuild a ring."""

    def membership_changed(self, replicas: Sequence[ReplicaState]) -> None: ...


@runtime_checkable
class TracksPrefill(Protocol):
    """Told when a request is sent to a replica and when its prefill is over (first byte,
    failure or end of the request; `prefilled` may come more than once and must be
    idempotent), e.g. to count the prefill each replica still has to do."""

    def dispatched(self, request: RouteRequest, replica: ReplicaId) -> None: ...

    def prefilled(self, request: RouteRequest) -> None: ...


@runtime_checkable
class EstimatesCachedTokens(Protocol):
    """How many leading prompt tokens `replica` likely holds in its prefix cache.

    Policies with a prefix index implement it; admission (to rank waiting requests by
    uncached work) and PD (to decide whether disaggregation pays) ask it. Cheap and pure.
    """

    def cached_tokens(self, request: RouteRequest, replica: ReplicaId) -> int: ...


@runtime_checkable
class HandlesSaturation(Protocol):
    """A scorer that weighs saturation itself (its own load bound on the sticky or cached
    replica): the composed router does not demote saturated replicas before it, and the
    store's sticky layer does not reorder its ranking."""

    handles_saturation: ClassVar[bool]


def weighs_saturation(policy: object) -> bool:
    """Whether `policy` bounds saturation itself (`HandlesSaturation`)."""
    return isinstance(policy, HandlesSaturation) and policy.handles_saturation


@runtime_checkable
class Composite(Protocol):
    """A policy made of other policies: a wrapper's inner router, a composed router's
    scorer and fallback. The first part is the primary one (the one that ranks)."""

    def parts(self) -> tuple[Policy, ...]: ...


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What a policy may receive at construction besides its own config."""

    replicas: tuple[ReplicaState, ...] = ()
    seed: int = 0


class PolicyFactory(Protocol):
    Config: ClassVar[type[PolicyConfig]]

    def __call__(self, config: Any, context: PolicyContext) -> Policy: ...


def registered_names(builtins: Mapping[str, str], group: str) -> list[str]:
    """The built-in names and those installed under the entry-points `group`."""
    names = set(builtins)
    names.update(ep.name for ep in entry_points(group=group))
    return sorted(names)


def find_registered(name: str, builtins: Mapping[str, str], group: str) -> Any | None:
    """What `name` names: a built-in, then an installed entry point of `group`, then a
    literal `module:Class`; None when it is none of them (the caller says what was known).
    The one lookup order of every registry (policies, tier classifiers)."""
    if name in builtins:
        return import_string(builtins[name])
    for ep in entry_points(group=group):
        if ep.name == name:
            return ep.load()
    if ":" in name:
        return import_string(name)
    return None


def known_policy_names() -> list[str]:
    return registered_names(BUILTIN_POLICIES, ENTRY_POINT_GROUP)


def import_string(target: str) -> Any:
    """`module:attr` -> the attribute (policies, classifiers); a ConfigError otherwise."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"import string {target!r} must look like 'module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import module {module_name!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise ConfigError(f"module {module_name!r} has no attribute {attr!r}") from exc


def resolve_policy_class(name: str) -> PolicyFactory:
    """Find a policy class by registered name or `module:Class`."""
    found: PolicyFactory | None = find_registered(name, BUILTIN_POLICIES, ENTRY_POINT_GROUP)
    if found is not None:
        return found
    raise ConfigError(
        f"unknown routing policy {name!r}; known policies: {', '.join(known_policy_names())}"
        " (or give a 'module:Class' import string)",
        param="routing.policy",
    )


def build_policy(name: str, raw_config: Mapping[str, Any] | None, context: PolicyContext) -> Policy:
    """Resolve `name`, validate its config section and construct it."""
    cls = resolve_policy_class(name)
    config_cls: type[PolicyConfig] = getattr(cls, "Config", PolicyConfig)
    try:
        config = config_cls.model_validate(dict(raw_config or {}))
    except ValidationError as exc:
        raise ConfigError(
            f"invalid config for policy {name!r}: {exc}", param=f"routing.policies.{name}"
        ) from exc
    policy = cls(config, context)
    if not isinstance(policy, Policy):
        raise ConfigError(f"{name!r} does not implement choose(request, view)")
    return policy
