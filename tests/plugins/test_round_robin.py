from __future__ import annotations

from collections import Counter

import pytest
from pydantic import ValidationError

from gateway.errors import ConfigError
from gateway.policy import Policy, PolicyContext, build_policy
from gateway.testing.views import ViewBuilder, make_request
from plugins.round_robin import RoundRobin, RoundRobinConfig


def test_rotates_over_healthy_replicas_serving_the_model() -> None:
    view = ViewBuilder().replicas(4).unhealthy("r2").models("r3", "other").build()
    policy = RoundRobin(RoundRobinConfig(), PolicyContext())
    firsts = [policy.choose(make_request(model="m"), view).first for _ in range(6)]
    assert firsts == ["r0", "r1", "r0", "r1", "r0", "r1"]
    choice = policy.choose(make_request(), view)
    assert set(choice.ranked) == {"r0", "r1"} and choice.reason == "rotation"


def test_order_does_not_depend_on_listing_order() -> None:
    a = ViewBuilder().replica("b").replica("a").replica("c").build()
    b = ViewBuilder().replica("c").replica("a").replica("b").build()
    pa = RoundRobin(RoundRobinConfig(), PolicyContext())
    pb = RoundRobin(RoundRobinConfig(), PolicyContext())
    assert [pa.choose(make_request(), a).ranked for _ in range(3)] == [
        pb.choose(make_request(), b).ranked for _ in range(3)
    ]


def test_even_spread_and_no_candidates() -> None:
    view = ViewBuilder().replicas(3).build()
    policy = RoundRobin(RoundRobinConfig(), PolicyContext())
    counts = Counter(policy.choose(make_request(), view).first for _ in range(300))
    assert set(counts.values()) == {100}
    empty = ViewBuilder().replicas(2).unhealthy("r0", "r1").build()
    choice = policy.choose(make_request(), empty)
    assert choice.ranked == () and choice.reason == "no_candidates"


def test_resolves_by_name_and_rejects_unknown_config() -> None:
    policy = build_policy("round_robin", {}, PolicyContext())
    assert isinstance(policy, RoundRobin) and isinstance(policy, Policy)
    with pytest.raises(ConfigError):
        build_policy("round_robin", {"bogus": 1}, PolicyContext())
    with pytest.raises(ValidationError):
        RoundRobinConfig(bogus=1)  # type: ignore[call-arg]
