"""Router wrappers: one declared order, every optional ability passed through."""

from __future__ import annotations

import pytest

from gateway.app import build_app
from gateway.errors import ConfigError
from gateway.pd.cached import find_estimator
from gateway.pd.colocated import ColocatedFirst
from gateway.policy import (
    Composite,
    EstimatesCachedTokens,
    ObservesPlacement,
    TracksPrefill,
    weighs_saturation,
)
from gateway.routing import ComposedRouter
from gateway.settings import KvgateSettings
from gateway.state import GatewayState
from gateway.store.memory import MemoryStore
from gateway.store.sticky import StickyFirst
from gateway.testing.views import make_request
from gateway.types import Choice, ClusterView, ReplicaId, RouteRequest
from gateway.wrappers import ABILITIES, ROUTER_LAYERS, RouterWrapper, primary, walk


class _Base:
    name = "base"

    def __init__(self) -> None:
        self.dispatched_to: list[ReplicaId] = []

    def choose(self, request: RouteRequest, view: ClusterView) -> Choice:
        return Choice(tuple(r.id for r in view.replicas), "base")

    def cached_tokens(self, request: RouteRequest, replica: ReplicaId) -> int:
        return 42

    def dispatched(self, request: RouteRequest, replica: ReplicaId) -> None:
        self.dispatched_to.append(replica)

    def prefilled(self, request: RouteRequest) -> None:
        return None


class _Plain:
    name = "plain"

    def choose(self, request: RouteRequest, view: ClusterView) -> Choice:
        return Choice((), "none")


class _Publishing(RouterWrapper):
    name = "publishing"

    def choose(self, request: RouteRequest, view: ClusterView) -> Choice:
        return self.inner.choose(request, view)

    def placed(self, request: RouteRequest, replica: ReplicaId) -> None:
        self.last = replica


def abilities_of(router: object) -> frozenset[str]:
    """Names of the optional abilities `router` has."""
    return frozenset(proto.__name__ for proto, _ in ABILITIES if isinstance(router, proto))


def test_abilities_of_the_inner_router_pass_through_bound_to_it() -> None:
    base = _Base()
    wrapped = ColocatedFirst(_Publishing(base))
    assert abilities_of(wrapped) == {"EstimatesCachedTokens", "TracksPrefill", "ObservesPlacement"}
    assert isinstance(wrapped, EstimatesCachedTokens)
    assert wrapped.cached_tokens(make_request(), ReplicaId("r")) == 42
    assert isinstance(wrapped, TracksPrefill)
    wrapped.dispatched(make_request(), ReplicaId("r1"))
    assert base.dispatched_to == ["r1"]


def test_an_ability_the_inner_router_lacks_stays_absent() -> None:
    wrapped = ColocatedFirst(_Plain())
    assert abilities_of(wrapped) == frozenset()
    assert not isinstance(wrapped, EstimatesCachedTokens)
    assert not isinstance(wrapped, ObservesPlacement)


def _settings(**extra: object) -> KvgateSettings:
    return KvgateSettings(
        replicas=[
            {"url": "http://127.0.0.1:9", "id": "both", "models": ["m"]},
            {"url": "http://127.0.0.1:10", "id": "pre", "models": ["m"], "role": "prefill"},
        ],
        **extra,
    )


def test_admission_keeps_the_prefix_cache_estimate_behind_redis_store_and_pd() -> None:
    # The Redis store is never contacted: building the app connects nothing.
    settings = _settings(
        store={"backend": "redis", "url": "redis://127.0.0.1:9/0"},
        admission={"enabled": True},
    )
    state: GatewayState = build_app(settings).state.gateway
    assert state.router_layers == ["sticky", "pd_colocated"]
    router = state.router
    assert isinstance(router, EstimatesCachedTokens)  # the lineage policy's prefix index
    assert state.router_prefill is not None and state.router_placed is not None
    gate = state.extras["admission"]
    assert gate._cache is not None
    request = make_request(prefix_hashes=(1, 2, 3))
    assert gate._cache.cached_tokens(request, ReplicaId("both")) == 0


def test_layers_apply_only_in_the_declared_order() -> None:
    state: GatewayState = build_app(_settings()).state.gateway
    assert state.router_layers == ["pd_colocated"]
    with pytest.raises(ConfigError, match="must go inside"):
        state.wrap_router("sticky", lambda inner: inner)
    with pytest.raises(ConfigError, match="declared layers"):
        state.wrap_router("cors", lambda inner: inner)
    assert ROUTER_LAYERS.index("pools") < ROUTER_LAYERS.index("sticky")


class _Sticking(_Plain):
    name = "sticking"
    handles_saturation = True


def test_parts_are_declared_and_walked_through_every_layer() -> None:
    """Sticky over a composed router (scorer + fallback) under PD's layer: the walk finds
    every part, the primary is the scorer, its declared saturation handling is seen."""
    scorer, fallback = _Sticking(), _Base()
    composed = ComposedRouter(scorer, fallback, filters=("not_saturated",))
    sticky = StickyFirst(composed, MemoryStore())
    top = ColocatedFirst(sticky)
    assert isinstance(top, Composite) and top.parts() == (sticky,)
    assert composed.parts() == (scorer, fallback)
    assert list(walk(top)) == [top, sticky, composed, scorer, fallback]
    assert primary(top) is scorer and top.scorer is scorer
    assert weighs_saturation(scorer) and not weighs_saturation(fallback)
    assert sticky._scorer_sticks  # the store's layer keeps the scorer's own ranking
    # PD's estimate comes from the first part that has one: the fallback here.
    assert find_estimator(top) is not None
    assert find_estimator(top).cached_tokens(make_request(), ReplicaId("r")) == 42  # type: ignore[union-attr]
    assert find_estimator(ColocatedFirst(_Plain())) is None


def test_a_scorer_without_the_declaration_is_second_guessed() -> None:
    composed = ComposedRouter(_Plain(), filters=("not_saturated",))
    sticky = StickyFirst(composed, MemoryStore())
    assert composed.parts() == (composed.scorer,)
    assert not weighs_saturation(primary(sticky)) and not sticky._scorer_sticks
    assert composed._demote  # saturated replicas are demoted before a plain scorer
