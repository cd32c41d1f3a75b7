"""Quota enforcement: `acquire` per request (one verdict), then token charges and release.

`LocalLimiter` counts in this process. `RedisLimiter` (gateway.auth.redis_limiter) shares
the counts through the store's Redis and falls back to the local counts when Redis is
unavailable. Both keep every counter of gateway.auth.limits for each scope of the
principal (its key, its tenant).
"""

from __future__ import annotations

import contextlib
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
    """One admitted request's hold on its scopes' budgets.

    Tokens are charged as the work happens: the estimate when the request is dispatched,
    output tokens past it as they stream (`delivered`), the engine's `usage` at the end
    (`settle`). Nothing delivered is ever given back, and a refund is taken from the minute
    its charge went to (gone when that minute no longer counts), so it can never lift a
    window's budget above its limit.
    """

    __slots__ = (
        "_delivered",
        "_in",
        "_limiter",
        "_out",
        "_released",
        "_windows",
        "headers",
        "id",
        "scopes",
    )

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
        self._in = self._out = self._delivered = 0
        # Minute index -> [input, output] charged in it (a request spans two at most).
        self._windows: dict[int, list[int]] = {}
        self._released = False

    @property
    def charged(self) -> tuple[int, int]:
        return self._in, self._out

    def charge(self, input_tokens: int, output_tokens: int) -> None:
        """At dispatch: the request's estimated tokens."""
        self._add(input_tokens, output_tokens)

    def delivered(self, output_tokens: int) -> None:
        """`output_tokens` went to the client so far: charged now if past what was."""
        if output_tokens > self._delivered:
            self._delivered = output_tokens
            if output_tokens > self._out:
                self._add(0, output_tokens - self._out)

    def settle(
        self, input_tokens: int | None, output_tokens: int | None, *, exact: bool = False
    ) -> None:
        """At the end: the tokens used (None: keep that charge as it is). Never less output
        than was seen delivered, unless `exact` (the engine's own `usage`, which counts
        tokens where `delivered` counts the events carrying them)."""
        want_in = self._in if input_tokens is None else input_tokens
        want_out = self._out if output_tokens is None else output_tokens
        if not exact:
            want_out = max(want_out, self._delivered)
        d_in, d_out = want_in - self._in, want_out - self._out
        self._add(max(d_in, 0), max(d_out, 0))
        if d_in < 0 or d_out < 0:
            self._refund(max(-d_in, 0), max(-d_out, 0))

    def _add(self, input_tokens: int, output_tokens: int) -> None:
        if not (input_tokens or output_tokens):
            return
        index = self._limiter.window_index()
        held = self._windows.setdefault(index, [0, 0])
        held[0] += input_tokens
        held[1] += output_tokens
        self._in += input_tokens
        self._out += output_tokens
        self._limiter.add_tokens(self, input_tokens, output_tokens, index)

    def _refund(self, input_tokens: int, output_tokens: int) -> None:
        oldest = self._limiter.window_index() - 1
        self._in -= input_tokens
        self._out -= output_tokens
        for index in sorted(self._windows, reverse=True):
            held = self._windows[index]
            back_in, back_out = min(input_tokens, held[0]), min(output_tokens, held[1])
            if not (back_in or back_out):
                continue
            held[0] -= back_in
            held[1] -= back_out
            input_tokens -= back_in
            output_tokens -= back_out
            if index >= oldest:  # an older minute counts no more: nothing to give back
                self._limiter.add_tokens(self, -back_in, -back_out, index)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._limiter.release(self)


class Limiter(Protocol):
    async def acquire(self, scopes: Sequence[Scope]) -> Ticket | Verdict:
        """A ticket, or the refusing verdict (with Retry-After and headers)."""
        ...

    def window_index(self) -> int:
        """The current minute's index (where a charge made now goes)."""
        ...

    def add_tokens(self, ticket: Ticket, input_tokens: int, output_tokens: int, index: int) -> None:
        """Count tokens (negative: given back) in the minute `index`."""
        ...

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

    def locked(self) -> contextlib.AbstractContextManager[None]:
        """Held across one verdict's reads and writes (a no-op in one process; the
        workers' shared counters lock their file, gateway.auth.host_counters)."""
        return contextlib.nullcontext()

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

    def add(
        self, name: str, kind: int, amount: float, now: float, index: int | None = None
    ) -> None:
        """`amount` into minute `index` (default: now's); a minute that no longer counts
        takes nothing, and a count never goes below zero."""
        current = int(now / WINDOW_S)
        state = self._state(name, current)
        at = current if index is None else index
        if at == current:
            counts = state[2]
        elif at == current - 1:
            counts = state[1]
        else:
            return
        counts[kind] = max(0.0, counts[kind] + amount)

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
        with counters.locked():
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

    def window_index(self) -> int:
        return int(self.counters.wall() / WINDOW_S)

    def add_tokens(
        self, ticket: Ticket, input_tokens: int, output_tokens: int, index: int | None = None
    ) -> None:
        now = self.counters.wall()
        for scope in ticket.scopes:
            name = scope_name(scope)
            if input_tokens:
                self.counters.add(name, 1, input_tokens, now, index)
            if output_tokens:
                self.counters.add(name, 2, output_tokens, now, index)

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
