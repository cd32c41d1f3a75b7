"""plugins/spread.py on its own: what a new session owes, branch points, the band and the
depth a band would throw away."""

from __future__ import annotations

import pytest
from policy_views import replicas

from plugins.spread import BranchPoints, SessionTraffic, band, beyond_common


def test_nothing_is_owed_before_a_continued_turn_is_measured() -> None:
    traffic = SessionTraffic(alpha=0.5)
    assert traffic.owed() is None
    traffic.new_session()
    traffic.continued(None)  # moved, or no prefix: counts as a request, not as a turn's cost
    assert traffic.owed() is None


def test_a_session_owes_its_further_turns_at_a_continued_turns_cost() -> None:
    traffic = SessionTraffic(alpha=0.5)
    for _ in range(10):  # ten sessions of four requests each
        traffic.new_session()
        for _ in range(3):
            traffic.continued(2000.0)
    owed = traffic.owed()
    assert owed is not None
    # Three more requests per new session at 2,000 uncached tokens each (the counts decay a
    # little with every request, so not exactly 3).
    assert owed == pytest.approx(3 * 2000.0, rel=0.01)


def test_a_continued_turns_cost_is_a_running_mean() -> None:
    traffic = SessionTraffic(alpha=0.5)
    traffic.new_session()
    traffic.continued(1000.0)
    traffic.continued(3000.0)
    owed = traffic.owed()
    assert owed is not None
    turns = owed / 2000.0  # the mean of 1,000 and 3,000 at alpha 0.5
    assert turns == pytest.approx(2.0, rel=0.01)


def test_branch_points_count_new_sessions_where_their_cached_prefix_ends() -> None:
    points = BranchPoints(limit=8)
    prompt = (11, 12, 13, 14)
    points.opened(prompt, 2)
    points.opened((11, 12, 99), 2)
    points.opened(prompt, 0)  # nothing cached: no branch point
    assert points.sessions_at(prompt, 2) == 2
    assert points.sessions_at(prompt, 3) == 0
    assert points.sessions_at(prompt, 0) == 0


def test_branch_points_forget_the_least_recently_counted_past_the_limit() -> None:
    points = BranchPoints(limit=2)
    points.opened((1,), 1)
    points.opened((2,), 1)
    points.opened((1,), 1)  # 1 is now the most recent
    points.opened((3,), 1)  # evicts 2
    assert points.sessions_at((1,), 1) == 2
    assert points.sessions_at((2,), 1) == 0
    assert points.sessions_at((3,), 1) == 1


def test_the_band_admits_replicas_near_the_lowest_score() -> None:
    states = replicas(4)
    # Replica 3 carries twice the sessions and tokens of the others.
    chosen = band(states, [10, 10, 10, 20], [1e5, 1e5, 1e5, 2e5], session_band=0.2)
    assert chosen == frozenset(r.id for r in states[:3])


def test_with_a_zero_band_one_session_above_the_lowest_is_still_in() -> None:
    states = replicas(3)
    # Two live sessions on average: the band is 2 / 2 wide on the session ratio, so the
    # replica one session above the lowest is in and the one five above is not.
    chosen = band(states, [0, 1, 5], [0.0, 0.0, 0.0], session_band=0.0)
    assert chosen == frozenset(r.id for r in states[:2])


def test_the_depth_a_band_would_throw_away_is_beyond_what_most_replicas_hold() -> None:
    # A preamble of 10K everywhere, one replica also holds a 60K history.
    assert beyond_common([10_000, 70_000, 10_000, 10_000, 10_000]) == (1, 60_000)
    # Held by a majority: nothing is thrown away.
    assert beyond_common([70_000, 70_000, 70_000, 0, 0]) == (0, 0)
