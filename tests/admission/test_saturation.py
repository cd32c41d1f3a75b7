"""The pure saturation test, table-driven."""

from __future__ import annotations

import pytest

from gateway.admission.config import SaturationThresholds
from gateway.admission.saturation import is_saturated
from gateway.types import EngineLoad

T = SaturationThresholds(max_waiting=4, max_kv_usage=0.9, max_inflight=None)
T_INFLIGHT = SaturationThresholds(max_waiting=4, max_kv_usage=0.9, max_inflight=8)


def _load(waiting: float = 0, kv: float | None = 0.1) -> EngineLoad:
    return EngineLoad(waiting=waiting, running=4, kv_usage=kv, scraped_at=1.0)


@pytest.mark.parametrize(
    ("load", "inflight", "at_scrape", "thresholds", "saturated"),
    [
        (_load(), 0, 0, T, False),  # idle
        (_load(waiting=3), 5, 5, T, False),  # below the queue threshold
        (_load(waiting=4), 5, 5, T, True),  # at the queue threshold
        (_load(waiting=2), 7, 5, T, True),  # two sent since the scrape: queue estimated at 4
        (_load(waiting=5), 3, 5, T, False),  # two finished since the scrape: estimated 3
        (_load(kv=0.95), 5, 5, T, True),  # KV nearly full
        (_load(kv=0.95), 4, 5, T, False),  # ... but one request finished since: room
        (_load(kv=0.95), 6, 5, T, True),  # ... and one more sent: full again
        (_load(kv=None), 5, 5, T, False),  # engine exposes no KV metric: queue decides
        (None, 0, 0, T, False),  # unknown load, idle replica: admit
        (None, 1, 1, T, True),  # unknown load with work in flight: wait
        (None, 7, 7, T_INFLIGHT, False),  # unknown load, in-flight limit configured
        (None, 8, 8, T_INFLIGHT, True),
        (_load(), 8, 8, T_INFLIGHT, True),  # in-flight limit applies with fresh load too
        (
            _load(waiting=100, kv=1.0),
            50,
            50,
            SaturationThresholds(max_waiting=None, max_kv_usage=None),
            False,
        ),  # every threshold disabled
    ],
)
def test_is_saturated(
    load: EngineLoad | None,
    inflight: int,
    at_scrape: int,
    thresholds: SaturationThresholds,
    saturated: bool,
) -> None:
    assert is_saturated(load, inflight, at_scrape, thresholds) is saturated


T_TOKENS = SaturationThresholds(max_waiting=None, max_kv_usage=None, max_prompt_tokens=10_000)


@pytest.mark.parametrize(
    ("in_flight_tokens", "tokens", "saturated"),
    [
        (0, 50_000, False),  # alone, a prompt larger than the bound still goes
        (8_000, 2_000, False),
        (8_000, 2_001, True),
        (10_000, 0, False),  # weightless requests are never held by this bound
        (10_001, 0, True),
    ],
)
def test_prompt_token_budget(in_flight_tokens: int, tokens: int, saturated: bool) -> None:
    assert is_saturated(_load(), 3, 3, T_TOKENS, in_flight_tokens, tokens) is saturated


def test_held_back_thresholds() -> None:
    t = SaturationThresholds(
        max_waiting=4, max_kv_usage=0.8, max_inflight=3, max_prompt_tokens=1000
    )
    held = t.held_back(0.5)
    assert (held.max_waiting, held.max_kv_usage, held.max_inflight, held.max_prompt_tokens) == (
        2.0,
        0.4,
        2,  # 1.5 places rounds to the nearest whole place
        500,
    )
    assert t.held_back(0.0) is t


def test_held_back_counts_round_to_the_nearest_place_not_down() -> None:
    two = SaturationThresholds(max_inflight=2)
    # The default classes' holdbacks (10%, 25%) must not halve a two-slot replica.
    assert [two.held_back(h).max_inflight for h in (0.1, 0.25, 0.5, 0.9)] == [2, 2, 1, 1]
    assert SaturationThresholds(max_inflight=4).held_back(0.25).max_inflight == 3
