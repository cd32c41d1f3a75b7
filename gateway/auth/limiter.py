"""Quota enforcement: `acquire` per request (one verdict), then token charges and release.

`LocalLimiter` counts in this process. `RedisLimiter` (gateway.auth.redis_limiter) shares
the counts through the store's Redis and falls back to the local counts when Redis is
unavailable. Both keep every counter of gateway.auth.limits for each scope of the
principal (its key, its tenant).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from gateway.auth.limits import (
    KINDS,
    WINDOW_S,
    Scope,
    Usage,
    Verdict,
    headers_for,
    refusal,
)

Clock = Callable[[], float]


class Ticket:
    """One admitted request's hold on its scopes' budgets."""

    __slots__ = ("_charged", "_limiter", "_released", "headers", "id", "scopes")

    def __init__(
        self,
        limiter: Limiter,
        scopes: Sequence[Scope],
        ticket_id: str,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        self._limiter = limiter
        self.scopes = tuple(scopes)
        self.id = ticket_id
        self.headers = headers
        self._charged = (0, 0)
        self._released = False

    def charge(self, input_tokens: int, output_tokens: int) -> None:
        """Before the response: the request's estimated tokens."""
        self._charged = (input_tokens, output_tokens)
        self._limiter.add_tokens(self, input_tokens, output_tokens)

    def settle(self, input_tokens: int | None, output_tokens: int | None) -> None:
        """After the response: replace the estimate by the `usage` the engine reported."""
        given_in, given_out = self._charged
        d_in = 0 if input_tokens is None else input_tokens - given_in
        d_out = 0 if output_tokens is None else output_tokens - given_out
        self._charged = (given_in + d_in, given_out + d_out)
        if d_in or d_out:
            self._limiter.add_tokens(self, d_in, d_out)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._limiter.release(self)


class Limiter(Protocol):
    async def acquire(self, scopes: Sequence[Scope]) -> Ticket | Verdict:
        """A ticket, or the refusing verdict (with Retry-After and headers)."""
        ...

    def add_tokens(self, ticket: Ticket, input_tokens: int, output_tokens: int) -> None: ...

    def release(self, ticket: Ticket) -> None: ...


class TicketIds:
    __slots__ = ("_next", "_prefix")

    def __init__(self) -> None:
        self._prefix = os.urandom(6).hex()
        self._next = itertools.count(1).__next__

    def __call__(self) -> str:
        return f"{self._prefix}{self._next():x}"


class LocalCounters:
    """Per scope name: the minute index, previous and current counts per kind, in flight."""

    def __init__(self, wall: Clock = time.time) -> None:
        self.wall = wall
        self._windows: dict[str, tuple[int, list[float], list[float]]] = {}
        self._inflight: dict[str, int] = {}

    def elapsed(self, now: float) -> float:
        return now / WINDOW_S - int(now / WINDOW_S)

    def _state(self, name: str, index: int) -> tuple[int, list[float], list[float]]:
        state = self._windows.get(name)
        if state is None or state[0] < index - 1:
            state = (index, [0.0] * len(KINDS), [0.0] * len(KINDS))
        elif state[0] == index - 1:
            state = (index, state[2], [0.0] * len(KINDS))
        self._windows[name] = state
        return state

    def usage(self, name: str, now: float) -> Usage:
        _, previous, current = self._state(name, int(now / WINDOW_S))
        windows = tuple((previous[i], current[i]) for i in range(len(KINDS)))
        return Usage(windows, self._inflight.get(name, 0))

    def add(self, name: str, kind: int, amount: float, now: float) -> None:
        self._state(name, int(now / WINDOW_S))[2][kind] += amount

    def enter(self, name: str) -> None:
        self._inflight[name] = self._inflight.get(name, 0) + 1

    def leave(self, name: str) -> None:
        left = self._inflight.get(name, 0) - 1
        if left > 0:
            self._inflight[name] = left
        else:
            self._inflight.pop(name, None)


def scope_name(scope: Scope) -> str:
    return f"{scope[0]}:{scope[1]}"


def verdict_from(
    scopes: Sequence[Scope], usages: Sequence[Usage], elapsed: float
) -> tuple[Verdict | None, list[tuple[bytes, bytes]]]:
    """The refusal (if any scope refuses) and the headers of the first scope."""
    headers = headers_for(scopes[0][2], usages[0], elapsed) if scopes else []
    for scope, usage in zip(scopes, usages):
        refused = refusal(scope[2], usage, elapsed)
        if refused is not None:
            kind, wait = refused
            own = headers_for(scope[2], usage, elapsed)
            return Verdict(False, scope[0], kind, wait, tuple(own)), headers
    return None, headers


class LocalLimiter:
    """Quotas of this process only (`store.backend: memory`, or Redis unavailable)."""

    def __init__(self, counters: LocalCounters | None = None) -> None:
        self.counters = counters or LocalCounters()
        self._ids = TicketIds()

    async def acquire(self, scopes: Sequence[Scope]) -> Ticket | Verdict:
        return self.acquire_now(scopes)

    def acquire_now(
        self, scopes: Sequence[Scope], ticket_id: str | None = None
    ) -> Ticket | Verdict:
        counters = self.counters
        now = counters.wall()
        usages = [counters.usage(scope_name(s), now) for s in scopes]
        refused, headers = verdict_from(scopes, usages, counters.elapsed(now))
        if refused is not None:
            return refused
        for scope in scopes:
            name = scope_name(scope)
            counters.add(name, 0, 1, now)
            counters.enter(name)
        return Ticket(self, scopes, ticket_id or self._ids(), after_one(headers))

    def add_tokens(self, ticket: Ticket, input_tokens: int, output_tokens: int) -> None:
        now = self.counters.wall()
        for scope in ticket.scopes:
            name = scope_name(scope)
            if input_tokens:
                self.counters.add(name, 1, input_tokens, now)
            if output_tokens:
                self.counters.add(name, 2, output_tokens, now)

    def release(self, ticket: Ticket) -> None:
        for scope in ticket.scopes:
            self.counters.leave(scope_name(scope))


def after_one(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The admitted request itself uses one of the remaining requests."""
    out = []
    for name, value in headers:
        if name == b"x-ratelimit-remaining-requests":
            value = str(max(0, int(value) - 1)).encode()
        out.append((name, value))
    return out
