"""Quota arithmetic (pure) and the local limiter on a fake clock."""

from __future__ import annotations

from typing import Any

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


def _ticket_and_clock(limits: Limits) -> tuple[LocalLimiter, list[float], Any]:
    now = [6000.0]  # the start of minute 100
    limiter = LocalLimiter(LocalCounters(lambda: now[0]))
    return limiter, now, (("key", "k", limits),)


def _sliding(limiter: LocalLimiter, kind: int) -> float:
    counters = limiter.counters
    now = counters.wall()
    previous, current = counters.usage("key:k", now).windows[kind]
    return previous * (1 - counters.elapsed(now)) + current


async def test_output_is_charged_as_it_streams_and_never_given_back_below_delivered() -> None:
    limiter, _, scopes = _ticket_and_clock(Limits(output_tokens_per_minute=2000))
    ticket = await limiter.acquire(scopes)
    assert isinstance(ticket, Ticket)
    ticket.charge(10, 256)  # no max_tokens: the default estimate
    ticket.delivered(100)
    assert _sliding(limiter, 2) == 256  # inside the estimate: nothing more yet
    ticket.delivered(300)
    assert _sliding(limiter, 2) == 300  # past it: charged as it streams
    ticket.settle(None, 0)  # the client left: output settles on what it got
    assert ticket.charged == (10, 300) and _sliding(limiter, 2) == 300
    ticket.settle(10, 280, exact=True)  # the engine's usage is exact
    assert _sliding(limiter, 2) == 280


async def test_a_refund_after_the_minute_turned_comes_from_the_minute_charged() -> None:
    """The issue's boundary bug: 300 charged late in one minute and given back early in the
    next left the next minute at -300, the sliding budget above its limit."""
    limiter, now, scopes = _ticket_and_clock(Limits(output_tokens_per_minute=2000))
    now[0] += 59.0
    spent = await limiter.acquire(scopes)
    assert isinstance(spent, Ticket)
    spent.charge(0, 1500)
    spent.settle(None, 1500)
    refunded = await limiter.acquire(scopes)
    assert isinstance(refunded, Ticket)
    refunded.charge(0, 300)
    now[0] += 2.0  # into the next minute
    refunded.settle(None, 0)  # nothing delivered: given back, from the minute it was in
    counters = limiter.counters
    previous, current = counters.usage("key:k", now[0]).windows[2]
    assert (previous, current) == (1500, 0)
    assert _sliding(limiter, 2) <= 1500
    # Two minutes on, the charge has faded: a late refund takes nothing from anyone.
    late = await limiter.acquire(scopes)
    assert isinstance(late, Ticket)
    late.charge(0, 100)
    now[0] += 120.0
    late.settle(None, 0)
    assert counters.usage("key:k", now[0]).windows[2] == (0.0, 0.0)


async def test_input_stays_charged_and_only_usage_lowers_it() -> None:
    limiter, _, scopes = _ticket_and_clock(Limits(input_tokens_per_minute=20000))
    for _ in range(5):
        ticket = await limiter.acquire(scopes)
        assert isinstance(ticket, Ticket)
        ticket.charge(4200, 16)
        ticket.delivered(1)
        ticket.settle(None, 0)  # dropped after the first token: the prompt was prefilled
    refused = await limiter.acquire(scopes)
    assert not isinstance(refused, Ticket) and refused.kind == "input_tokens"


async def test_host_counters_are_one_budget_for_two_limiters(tmp_path: Any) -> None:
    """What two workers do: each its own HostCounters on the shared directory's file."""
    from gateway.auth.host_counters import HostCounters

    now = [6000.0]
    counters = [HostCounters(tmp_path, lambda: now[0]) for _ in range(2)]
    limiters = [LocalLimiter(c) for c in counters]
    scopes = (("key", "k", Limits(requests_per_minute=5, output_tokens_per_minute=100)),)
    got = [await limiters[i % 2].acquire(scopes) for i in range(6)]
    assert [isinstance(t, Ticket) for t in got] == [True] * 5 + [False]
    first = got[0]
    assert isinstance(first, Ticket)
    first.charge(0, 60)
    assert counters[1].usage("key:k", now[0]).windows[2] == (0.0, 60.0)
    now[0] += 61  # next minute: the refund comes from the one charged, in the shared file
    first.settle(None, 0)
    assert counters[1].usage("key:k", now[0]).windows[2] == (0.0, 0.0)
    assert counters[1].usage("key:k", now[0]).concurrent == 5
    for ticket in got[:5]:
        assert isinstance(ticket, Ticket)
        ticket.release()
    assert counters[0].usage("key:k", now[0]).concurrent == 0
    for c in counters:
        c.close()
