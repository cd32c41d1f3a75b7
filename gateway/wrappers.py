"""Router wrappers: one declared order, and every optional ability passed through.

Feature packages put policies around the configured router (the pool selector, the shared
store's `StickyFirst`, PD's `ColocatedFirst`). Two rules keep that composable:

* **One order.** `ROUTER_LAYERS` lists the layers innermost first; `GatewayState.wrap_router`
  applies a layer only after every layer before it in this list, and fails start-up
  otherwise, so the composition never depends on which installer happened to run first.
* **Nothing is lost.** A wrapper derived from `RouterWrapper` exposes each optional ability
  (`gateway.policy`: placement, outcome, membership, prefill tracking, cached-token
  estimates) that its inner router has and it does not define itself, bound straight to the
  inner method (no extra call per request). An ability the inner router lacks stays absent,
  so `isinstance(router, EstimatesCachedTokens)` and friends stay truthful: admission and PD
  see the base router's prefix-cache estimate whatever wraps it.
"""

from __future__ import annotations

from collections.abc import Iterator

from gateway.policy import (
    Composite,
    EstimatesCachedTokens,
    ObservesOutcome,
    ObservesPlacement,
    Policy,
    ReactsToMembership,
    TracksPrefill,
)

# Innermost first. "pools" replaces the configured router by one router per pool behind
# the pool selector; "sticky" (gateway.store) reorders the pool-safe ranking for the
# session's recorded replica; "pd_colocated" (gateway.pd) narrows the view every inner
# layer sees to the replicas that serve whole requests.
ROUTER_LAYERS: tuple[str, ...] = ("pools", "sticky", "pd_colocated")

# Each optional ability and the attributes that make it.
ABILITIES: tuple[tuple[type, tuple[str, ...]], ...] = (
    (ObservesPlacement, ("placed",)),
    (ObservesOutcome, ("finished",)),
    (ReactsToMembership, ("membership_changed",)),
    (TracksPrefill, ("dispatched", "prefilled")),
    (EstimatesCachedTokens, ("cached_tokens",)),
)


class RouterWrapper:
    """Base of a policy around one inner policy (see the module docstring).

    A subclass defines `choose` and any ability it changes (calling the inner one itself,
    when the inner has it); the others are bound through at construction.
    """

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        own = type(self)
        for proto, names in ABILITIES:
            if isinstance(inner, proto):
                for name in names:
                    if not hasattr(own, name):
                        setattr(self, name, getattr(inner, name))

    def parts(self) -> tuple[Policy, ...]:
        """`Composite`: the inner router."""
        return (self.inner,)

    @property
    def scorer(self) -> Policy:
        """The policy that ranks, under every wrapper and composition (`primary`)."""
        return primary(self.inner)


def walk(router: Policy) -> Iterator[Policy]:
    """`router`, then the parts it is made of (`Composite`), depth first: the one way
    feature packages look into a composed router for an ability."""
    yield router
    if isinstance(router, Composite):
        for part in router.parts():
            yield from walk(part)


def primary(router: Policy) -> Policy:
    """The policy that ranks: the first part, followed down to one made of no parts."""
    while isinstance(router, Composite) and (parts := router.parts()):
        router = parts[0]
    return router
