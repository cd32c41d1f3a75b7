"""Ranking as pure functions: class first, then size, and aging that rules out starvation."""

from __future__ import annotations

import heapq
import itertools

import pytest

from gateway.admission.config import AdmissionSettings, PriorityClass
from gateway.admission.order import (
    Ordering,
    expected_output,
    predicted_work,
    request_score,
    score,
    size_fraction,
)
from gateway.types import RouteRequest, SessionKey


def _ordering(**overrides: object) -> Ordering:
    return Ordering.from_settings(AdmissionSettings.model_validate(overrides))


def _req(
    cls: str = "default", prompt: int = 100, max_tokens: int | None = 16, **kw: object
) -> RouteRequest:
    return RouteRequest(
        request_id="r",
        model="m",
        session_key=SessionKey("s"),
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        priority_class=cls,
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("max_tokens", "tenant_avg", "expected"),
    [
        (None, None, 256.0),  # nothing known: the default
        (50, None, 50.0),  # max_tokens bounds the output
        (100_000, None, 1024.0),  # ... but is capped
        (None, 40.0, 40.0),  # the tenant's history when max_tokens is absent
        (2000, 40.0, 40.0),  # history wins when it is smaller than the bound
        (10, 40.0, 10.0),  # the bound wins when it is smaller than history
        (0, None, 256.0),  # max_tokens 0 is no information
        (None, 5000.0, 1024.0),  # history is capped too
    ],
)
def test_expected_output(max_tokens: int | None, tenant_avg: float | None, expected: float) -> None:
    assert expected_output(max_tokens, tenant_avg, cap=1024, default=256) == expected


def test_predicted_work_counts_only_uncached_prompt() -> None:
    assert predicted_work(1000, 0, 100, 1.0) == 1100
    assert predicted_work(1000, 900, 100, 1.0) == 200
    assert predicted_work(1000, 5000, 100, 2.0) == 200  # cache bigger than prompt: no prefill
    assert predicted_work(1000, -3, 0, 1.0) == 1000


def test_size_fraction_is_monotonic_and_bounded() -> None:
    sizes = [0, 1, 10, 100, 1000, 10_000, 32_768, 10**6]
    fracs = [size_fraction(s, 32_768) for s in sizes]
    assert fracs == sorted(fracs)
    assert fracs[0] == 0.0 and fracs[-1] == 1.0 and fracs[-2] == 1.0
    # Each decade buys a visible head start, even far below the cap.
    assert fracs[3] - fracs[2] > 0.2


def test_higher_class_goes_first_among_simultaneous_arrivals() -> None:
    o = _ordering()
    interactive_long = request_score(_req("interactive", prompt=30_000, max_tokens=1000), 0.0, o)
    batch_short = request_score(_req("batch", prompt=10, max_tokens=1), 0.0, o)
    default_mid = request_score(_req("default", prompt=500), 0.0, o)
    assert interactive_long < default_mid < batch_short


def test_shorter_work_goes_first_within_a_class() -> None:
    o = _ordering()
    short = request_score(_req(prompt=200, max_tokens=32), 0.0, o)
    long = request_score(_req(prompt=8000, max_tokens=32), 0.0, o)
    assert short < long


def test_cached_prefix_makes_a_long_prompt_short() -> None:
    o = _ordering()
    cold = request_score(_req(prompt=8000), 0.0, o)
    warm = request_score(_req(prompt=8000), 0.0, o, cached_tokens=7900)
    short = request_score(_req(prompt=100), 0.0, o)
    assert warm < cold
    assert warm == pytest.approx(short, abs=1e-9)


def test_tenant_history_shortens_prediction() -> None:
    o = _ordering()
    greedy = request_score(_req(prompt=100, max_tokens=1000), 0.0, o)
    known_terse = request_score(_req(prompt=100, max_tokens=1000), 0.0, o, tenant_average=5)
    assert known_terse < greedy


def test_unknown_class_ranks_with_the_last_class() -> None:
    o = _ordering()
    assert request_score(_req("nope"), 0.0, o) == request_score(_req("batch"), 0.0, o)


def test_aging_overtakes_after_the_bound() -> None:
    o = _ordering(class_head_start_s=3.0, size_head_start_s=2.0)
    assert o.aging_bound_s == pytest.approx(8.0)
    worst = score(0.0, 2, 10**9, o)  # batch, huge: the worst possible rank at t=0
    best_later = score(o.aging_bound_s + 1e-6, 0, 0, o)  # the best rank, arriving later
    assert worst < best_later
    # ... while just before the bound the newcomer still wins.
    assert score(o.aging_bound_s - 0.01, 0, 0, o) < worst


def test_no_starvation_under_endless_high_class_short_traffic() -> None:
    """One long batch request against a server that can never keep up with short ones.

    Short interactive requests arrive twice as fast as the server releases; under strict
    priority the batch request would wait forever. With aging it is overtaken only by
    requests that arrived less than `aging_bound_s` after it, so it is released once those
    (finitely many) are served.
    """
    o = _ordering(class_head_start_s=2.0, size_head_start_s=1.0)
    service_s = 0.1
    arrival_s = 0.05
    heap: list[tuple[float, int, float, str]] = []
    seq = itertools.count()
    heapq.heappush(heap, (score(0.0, 2, 50_000, o), next(seq), 0.0, "batch-long"))
    now, next_arrival, released_at = 0.0, 0.0, None
    overtaken_by: list[float] = []
    while now < 120.0 and released_at is None:
        while next_arrival <= now:
            heapq.heappush(heap, (score(next_arrival, 0, 50, o), next(seq), next_arrival, "s"))
            next_arrival += arrival_s
        _, _, arrived, name = heapq.heappop(heap)
        if name == "batch-long":
            released_at = now
        else:
            overtaken_by.append(arrived)
        now += service_s
    assert released_at is not None, "the batch request starved"
    assert max(overtaken_by) < o.aging_bound_s
    assert released_at <= (o.aging_bound_s / arrival_s + 1) * service_s
    # Strict priority did hold while the batch request was young.
    assert len(overtaken_by) > (o.aging_bound_s - 1.0) / arrival_s


def test_ordering_reads_class_order_from_settings() -> None:
    s = AdmissionSettings(
        classes=(PriorityClass(name="gold"), PriorityClass(name="silver")), default_class="gold"
    )
    o = Ordering.from_settings(s)
    assert o.class_index == {"gold": 0, "silver": 1}
    assert request_score(_req("gold"), 0.0, o) < request_score(_req("silver"), 0.0, o)


def test_backfill_window_may_not_outlast_the_size_head_start() -> None:
    # A longer window would let a later arrival overtake a waiter past the aging bound.
    with pytest.raises(ValueError, match="backfill_s"):
        AdmissionSettings(size_head_start_s=2.0, backfill_s=3.0)
    assert AdmissionSettings(size_head_start_s=2.0, backfill_s=2.0).backfill_s == 2.0
    assert AdmissionSettings().backfill_s == 0.0  # off unless configured
