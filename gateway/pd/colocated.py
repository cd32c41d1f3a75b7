"""`ColocatedFirst`: keeps whole (non-disaggregated) requests off replicas that should
not serve them alone (prefill replicas; SGLang decode servers, see
`PDSettings.serves_whole`).

A policy wrapper: while any healthy replica able to serve whole requests serves the model,
the inner policy ranks only those; otherwise it ranks everything, so a PD replica serving a
whole request is the last resort rather than an outage. Cost: O(n) once per cluster
snapshot and model (the narrowed tuple is reused, so inner policies caching on it stay O(1)).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import ClassVar

from gateway.policy import Policy
from gateway.types import Choice, ClusterView, ReplicaId, ReplicaState, Role, RouteRequest
from gateway.wrappers import RouterWrapper

_Narrowed = tuple[tuple[ReplicaState, ...], Mapping[ReplicaId, ReplicaState]]


class ColocatedFirst(RouterWrapper):
    name: ClassVar[str] = "pd_colocated"

    def __init__(
        self,
        inner: Policy,
        serves_whole: Callable[[ReplicaState], bool] = lambda r: r.role is Role.BOTH,
    ) -> None:
        super().__init__(inner)
        self._serves_whole = serves_whole
        self._source: tuple[ReplicaState, ...] | None = None
        self._by_model: dict[str, _Narrowed | None] = {}

    def choose(self, request: RouteRequest, view: ClusterView) -> Choice:
        narrowed = self._narrow(request.model, view)
        if narrowed is None:
            return self.inner.choose(request, view)
        replicas, by_id = narrowed
        sub = ClusterView(
            replicas, view.now, view.stale_after, view.in_flight, by_id, view.cache_evidence
        )
        return self.inner.choose(request, sub)

    def _narrow(self, model: str, view: ClusterView) -> _Narrowed | None:
        """Role-`both` replicas, or None when the view should be used as it is."""
        if view.replicas is not self._source:
            self._source = view.replicas
            self._by_model.clear()
        if model in self._by_model:
            return self._by_model[model]
        both = tuple(r for r in view.replicas if self._serves_whole(r))
        usable = any(r.healthy and r.serves(model) for r in both)
        result: _Narrowed | None = None
        if usable and len(both) < len(view.replicas):
            result = (both, MappingProxyType({r.id: r for r in both}))
        self._by_model[model] = result
        return result
