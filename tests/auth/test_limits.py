"""Quota arithmetic (pure) and the local limiter on a fake clock."""

from __future__ import annotations

import pytest

from gateway.auth.config import Limits
from gateway.auth.limiter import LocalCounters, LocalLimiter, Ticket
from gateway.auth.limits import Usage, estimate, refusal, reset_text, wait_s


@pytest.mark.parametrize(
    ("previous", "current", "elapsed", "limit", "need", "expected"),
    [
        (0, 0, 0.5, 10, 1, 0.0),  # room now
        (0, 10, 0.5, 10, 1, 30.0 + 6.0),  # this minute is full: its end, then 10% of the next
        (10, 0, 0.05, 10, 1, 3.0),  # the previous minute fades to 9 at 10% of this one
        (5, 5, 0.0, 10, 1, 12.0),  # 5*(1-x)+5 <= 9 -> x >= 0.2
    ],
)
def test_wait_until_room(
    previous: float, current: float, elapsed: float, limit: float, need: float, expected: float
) -> None:
    assert wait_s(previous, current, elapsed, limit, need) == pytest.approx(expected)
    # After that wait the sliding total indeed leaves room (checked on the formula itself).
    if expected and current <= limit - need:
        x = elapsed + expected / 60
        assert estimate(previous, current, x) <= limit - need + 1e-9


def test_reset_text_is_openai_shaped() -> None:
    assert [reset_text(s) for s in (0.02, 1.0, 1.2, 59.5, 360.0)] == [
        "20ms",
        "1s",
        "2s",
        "1m0s",
        "6m0s",
    ]


def test_refusal_names_the_counter() -> None:
    limits = Limits(requests_per_minute=2, output_tokens_per_minute=100, concurrent_requests=1)
    empty = ((0.0, 0.0),) * 3
    assert refusal(limits, Usage(empty), 0.5) is None
    assert refusal(limits, Usage(((0, 2), (0, 0), (0, 0))), 0.5) == (
        "requests",
        pytest.approx(30 + 30),
    )
    kind, _ = refusal(limits, Usage(((0, 0), (0, 0), (0, 100))), 0.5) or ("", 0)
    assert kind == "output_tokens"
    assert refusal(limits, Usage(empty, concurrent=1), 0.5) == ("concurrent", 1.0)


async def test_local_limiter_counts_requests_tokens_and_slots() -> None:
    now = [6000.0]
    limiter = LocalLimiter(LocalCounters(lambda: now[0]))
    scopes = (
        (
            "key",
            "k",
            Limits(requests_per_minute=3, input_tokens_per_minute=100, concurrent_requests=2),
        ),
    )
    first = await limiter.acquire(scopes)
    second = await limiter.acquire(scopes)
    assert isinstance(first, Ticket) and isinstance(second, Ticket)
    assert dict(first.headers)[b"x-ratelimit-remaining-requests"] == b"2"
    busy = await limiter.acquire(scopes)
    assert not isinstance(busy, Ticket) and busy.kind == "concurrent"
    first.release()
    first.release()  # idempotent
    first.charge(80, 0)
    first.settle(120, None)  # usage said 120: the budget is now spent
    spent = await limiter.acquire(scopes)
    assert not isinstance(spent, Ticket) and spent.kind == "input_tokens"
    now[0] += 120  # two minutes later everything has faded
    second.release()
    fresh = await limiter.acquire(scopes)
    assert isinstance(fresh, Ticket)
