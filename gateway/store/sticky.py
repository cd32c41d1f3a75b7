"""`StickyFirst`: honour the session store's placement when the replica can take it.

Wraps the configured router. The inner ranking is kept, except that the session's recorded
replica (`RouteRequest.sticky_replica`) goes first when the inner router still ranks it
(so it passed the health and model filters) and it is not overloaded: its in-flight count
is within `load_factor` x the mean over the ranked replicas (+ `OVERLOAD_SLACK`), and its
scraped load, when known, is not saturated. Otherwise the inner choice stands and the proxy records the move.

It also shares prefix placements: `placed` forwards to the inner router and publishes the
placement to the store, for the prefix-affinity index of the other instances.

Cost: O(n) over the ranked list, only when a sticky replica is set and not already first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from gateway.policy import ObservesPlacement, Policy, weighs_saturation
from gateway.routing import SaturationLimits, is_saturated
from gateway.store.base import PrefixPlacement, Store
from gateway.types import Choice, ClusterView, ReplicaId, RouteRequest
from gateway.wrappers import RouterWrapper

# In-flight requests a sticky replica may carry above the bound: at light load a bound of
# the mean alone would move a session off its cache for one extra request.
OVERLOAD_SLACK = 2.0


class StickyFirst(RouterWrapper):
    name: ClassVar[str] = "sticky"

    def __init__(
        self,
        inner: Policy,
        store: Store,
        *,
        load_factor: float | None = 1.25,
        saturation: SaturationLimits | None = None,
    ) -> None:
        super().__init__(inner)
        self.store = store
        self.load_factor = load_factor
        self.saturation = saturation or SaturationLimits()
        self._placed = inner.placed if isinstance(inner, ObservesPlacement) else None
        # A scorer that honours `sticky_replica` itself, with its own load bound, keeps
        # its ranking: reordering here would apply a second, different bound.
        self._scorer_sticks = weighs_saturation(self.scorer)

    def choose(self, request: RouteRequest, view: ClusterView) -> Choice:
        choice = self.inner.choose(request, view)
        if self._scorer_sticks:
            return choice
        sticky = request.sticky_replica
        ranked = choice.ranked
        if sticky is None or not ranked or ranked[0] == sticky or sticky not in ranked:
            return choice
        if self._overloaded(sticky, ranked, view):
            return choice
        reordered = (sticky, *(r for r in ranked if r != sticky))
        return Choice(reordered, "sticky", choice.policy)

    def _overloaded(
        self, sticky: ReplicaId, ranked: Sequence[ReplicaId], view: ClusterView
    ) -> bool:
        replica = view.by_id.get(sticky)
        if replica is None:
            return True
        # Unknown load is not held against a sticky replica: that would end stickiness
        # whenever scraping is off or late. Only a known, saturated load moves the session.
        load = replica.load
        fresh = load is not None and load.is_fresh(view.now, view.stale_after)
        if fresh and is_saturated(load, self.saturation):
            return True
        if self.load_factor is None:
            return False
        mean = sum(view.inflight(r) for r in ranked) / len(ranked)
        return view.inflight(sticky) > self.load_factor * mean + OVERLOAD_SLACK

    def placed(self, request: RouteRequest, replica: ReplicaId) -> None:
        if self._placed is not None:
            self._placed(request, replica)
        if request.prefix_hashes:
            self.store.publish_prefix(
                PrefixPlacement(request.model, replica, request.prefix_hashes, request.block_tokens)
            )

    def place_remote(self, placement: PrefixPlacement) -> None:
        """A placement another instance made: index it in the inner router only."""
        if self._placed is None:
            return
        hashes = placement.prefix_hashes
        request = RouteRequest(
            request_id="",
            model=placement.model,
            session_key=_REMOTE_SESSION,
            prefix_hashes=hashes,
            block_tokens=placement.block_tokens,
            prompt_tokens=len(hashes) * placement.block_tokens,
        )
        self._placed(request, placement.replica)


_REMOTE_SESSION: Any = "kvgate-remote-placement"
