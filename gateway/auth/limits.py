"""Quota arithmetic (pure): one-minute sliding windows, verdicts, Retry-After, headers.

A window's total is the current fixed minute's count plus the previous minute's weighted
by the share of it the sliding window still covers (gateway.store.windows). A request is
refused when one more request, or any more tokens, would pass a limit; a token budget is
checked against what was already used (a request's own tokens are only known later), so
it may be overshot by the last admitted request, as OpenAI's own limits are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.auth.config import Limits
from gateway.auth.principal import Principal

WINDOW_S = 60.0
# Counters per scope: requests, input tokens, output tokens.
KINDS = ("requests", "input_tokens", "output_tokens")


@dataclass(frozen=True, slots=True)
class Usage:
    """One scope's counters as read: (previous, current) minute per kind, and in flight."""

    windows: tuple[tuple[float, float], ...]  # per KINDS
    concurrent: int = 0


def estimate(previous: float, current: float, elapsed: float) -> float:
    """Sliding total; `elapsed` is the share (0..1) of the current minute gone by."""
    return previous * (1.0 - elapsed) + current


def wait_s(previous: float, current: float, elapsed: float, limit: float, need: float) -> float:
    """Seconds until the sliding total leaves room for `need` more (at most two minutes)."""
    room = limit - need
    if room < 0:
        return 2 * WINDOW_S
    if current <= room:
        # The previous minute's share must shrink enough within this minute.
        if previous <= 0:
            return 0.0
        x = 1.0 - (room - current) / previous
        return max(0.0, (x - elapsed) * WINDOW_S)
    # Only in the next minute, once this minute's count has faded enough.
    rest = (1.0 - elapsed) * WINDOW_S
    return rest + max(0.0, 1.0 - room / current) * WINDOW_S


def reset_text(seconds: float) -> str:
    """OpenAI's x-ratelimit-reset-* format: "20ms", "1s", "6m0s"."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    scope: str = ""  # "key" or "tenant", of the refusing (or tightest) limit
    kind: str = ""  # which counter refused: one of KINDS or "concurrent"
    retry_after_s: float = 0.0
    headers: tuple[tuple[bytes, bytes], ...] = ()


def limit_values(limits: Limits) -> tuple[int | None, int | None, int | None, int | None]:
    """(requests, input, output per minute, concurrent), the order counters are kept in."""
    return (
        limits.requests_per_minute,
        limits.input_tokens_per_minute,
        limits.output_tokens_per_minute,
        limits.concurrent_requests,
    )


Scope = tuple[str, str, Limits]  # ("key" | "tenant", its name, its limits)


def scopes_of(principal: Principal) -> tuple[Scope, ...]:
    out: list[Scope] = []
    if principal.key_limits.any:
        out.append(("key", principal.name, principal.key_limits))
    if principal.tenant_limits.any:
        out.append(("tenant", principal.tenant, principal.tenant_limits))
    return tuple(out)


def refusal(limits: Limits, usage: Usage, elapsed: float) -> tuple[str, float] | None:
    """(kind, seconds to wait) when this scope refuses one more request, else None."""
    values = limit_values(limits)
    for i, kind in enumerate(KINDS):
        limit = values[i]
        if limit is None:
            continue
        previous, current = usage.windows[i]
        need = 1.0 if i == 0 else 0.0
        total = estimate(previous, current, elapsed)
        if (i == 0 and total + need > limit) or (i > 0 and total >= limit):
            # Tokens: wait until at least one token of room shows.
            wanted = need if i == 0 else 1.0
            return kind, max(0.001, wait_s(previous, current, elapsed, limit, wanted))
    conc = values[3]
    if conc is not None and usage.concurrent + 1 > conc:
        return "concurrent", 1.0  # unknown: when a request in flight ends
    return None


def headers_for(limits: Limits, usage: Usage, elapsed: float) -> list[tuple[bytes, bytes]]:
    """OpenAI's x-ratelimit-* headers for one scope (tokens: the tighter token budget)."""
    values = limit_values(limits)
    out: list[tuple[bytes, bytes]] = []
    rpm = values[0]
    if rpm is not None:
        previous, current = usage.windows[0]
        used = estimate(previous, current, elapsed)
        out += [
            (b"x-ratelimit-limit-requests", str(rpm).encode()),
            (b"x-ratelimit-remaining-requests", str(max(0, math.floor(rpm - used))).encode()),
            (
                b"x-ratelimit-reset-requests",
                reset_text(wait_s(previous, current, elapsed, rpm, rpm)).encode(),
            ),
        ]
    best: tuple[float, int, float] | None = None  # (remaining, limit, reset)
    for i in (1, 2):
        limit = values[i]
        if limit is None:
            continue
        previous, current = usage.windows[i]
        remaining = limit - estimate(previous, current, elapsed)
        if best is None or remaining < best[0]:
            best = (remaining, limit, wait_s(previous, current, elapsed, limit, limit))
    if best is not None:
        out += [
            (b"x-ratelimit-limit-tokens", str(best[1]).encode()),
            (b"x-ratelimit-remaining-tokens", str(max(0, math.floor(best[0]))).encode()),
            (b"x-ratelimit-reset-tokens", reset_text(best[2]).encode()),
        ]
    return out
