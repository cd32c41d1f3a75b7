"""A replica that leaves the cluster takes what the policies learnt about it along: when it
comes back (a restarted engine, empty cache) no policy still credits it with a prefix, and
the replicas that stayed keep theirs."""

from __future__ import annotations

import pytest
from policy_views import replicas, request

from gateway.policy import (
    BUILTIN_POLICIES,
    EstimatesCachedTokens,
    ObservesPlacement,
    PolicyContext,
    ReactsToMembership,
    build_policy,
)
from gateway.types import ReplicaId

STATES = replicas(3)


def _learning_policies() -> list[str]:
    names = []
    for name in sorted(BUILTIN_POLICIES):
        p = build_policy(name, {}, PolicyContext(STATES))
        if all(
            isinstance(p, ability)
            for ability in (EstimatesCachedTokens, ObservesPlacement, ReactsToMembership)
        ):
            names.append(name)
    return names


LEARNING = _learning_policies()


def test_some_policies_learn_placements() -> None:
    assert LEARNING  # else the test below would check nothing


@pytest.mark.parametrize("name", LEARNING)
def test_a_replica_that_leaves_and_returns_holds_nothing(name: str) -> None:
    policy = build_policy(name, {}, PolicyContext(STATES))
    assert isinstance(policy, EstimatesCachedTokens | ObservesPlacement | ReactsToMembership)
    leaver, stayer = ReplicaId("r1"), ReplicaId("r0")
    on_leaver = request("a", [101, 102, 103, 104])
    on_stayer = request("b", [201, 202, 203])
    policy.placed(on_leaver, leaver)  # type: ignore[union-attr]
    policy.placed(on_stayer, stayer)  # type: ignore[union-attr]
    cached = policy.cached_tokens  # type: ignore[union-attr]
    assert cached(on_leaver, leaver) > 0 and cached(on_stayer, stayer) > 0
    before = cached(on_stayer, stayer)
    policy.membership_changed([s for s in STATES if s.id != leaver])  # type: ignore[union-attr]
    policy.membership_changed(STATES)  # type: ignore[union-attr]
    assert cached(on_leaver, leaver) == 0
    assert cached(on_stayer, stayer) == before
