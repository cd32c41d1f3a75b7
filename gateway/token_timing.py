"""Per-token latency of a relayed stream: time to first token, inter-token latency, TPOT.

The relay calls `StreamTimer.feed(chunk)` with every upstream chunk as it arrives and
`finish(completion_tokens)` once at the end. A chunk carries a token when one of its SSE
events has content: a non-empty `delta.content`, `delta.reasoning_content` /
`delta.reasoning`, a `delta.tool_calls` entry (chat), a non-empty `text` (completions, and
Anthropic's `text_delta`) or a string `delta` (Responses). The closing events of a Responses
stream repeat the whole text and count as one token more each.
The role-only first event vLLM sends, keep-alive comments, usage-only and `[DONE]` events
carry none, so time to first token is not time to first byte.

Events are recognised by their bytes, not parsed: a JSON string value cannot contain an
unescaped quote, so `"content":"x` only ever matches the key itself, and no token costs a
JSON parse. Upstream chunks need not end on an event boundary: an incomplete trailing
event is held (up to `MAX_HELD_BYTES`) and counted once it is complete.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

MAX_HELD_BYTES = 65536

# `"delta":"x` is the Responses API's text delta (chat's and Anthropic's deltas are objects).
_HAS_TOKEN = re.compile(
    rb'"(?:content|reasoning_content|reasoning|text|delta)"\s*:\s*"(?!")'
    rb'|"tool_calls"\s*:\s*\[\s*\{'
)
_BOUNDARY = re.compile(rb"\r?\n\r?\n")

Observe = Callable[[float], None]


class TokenEvents:
    """Counts the SSE events that carry a token, across chunk boundaries."""

    __slots__ = ("_counted_held", "_held")

    def __init__(self) -> None:
        self._held = b""
        self._counted_held = False  # the held oversized event was already counted

    def feed(self, chunk: bytes) -> int:
        data = self._held + chunk if self._held else chunk
        # The last event boundary ("\n\n", or "\r\n\r\n", whose tail is "\n\r\n").
        lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\n\r\n")
        end = max(lf + 2 if lf >= 0 else -1, crlf + 3 if crlf >= 0 else -1)
        if end < 0:
            self._held = data
            return self._hold_limit()
        complete, self._held = data[:end], data[end:]
        skip = self._counted_held
        self._counted_held = False
        if not skip and complete.find(b"\n\n") == lf and crlf < 0:
            # One whole event (the engines write one per token): one search, no split.
            return (1 if _HAS_TOKEN.search(complete) else 0) + self._hold_limit()
        # bytes.split is the regex's split when no "\r" can make a "\r\n" boundary, and
        # some 15 times cheaper (the optional "\r" keeps re from searching for a literal).
        events = _BOUNDARY.split(complete) if b"\r" in complete else complete.split(b"\n\n")
        if skip:
            events = events[1:]
        search = _HAS_TOKEN.search
        return sum(1 for event in events if search(event)) + self._hold_limit()

    def _hold_limit(self) -> int:
        """An event past the size bound is counted now (once) and no longer held whole."""
        if len(self._held) <= MAX_HELD_BYTES:
            return 0
        counted = 0
        if not self._counted_held and _HAS_TOKEN.search(self._held):
            counted = 1
        self._counted_held = True
        # Keep only a tail: enough to see the boundary that ends the event.
        self._held = self._held[-3:]
        return counted


class StreamTimer:
    """Timing of one stream from `t0` (request arrival, `clock` units = seconds).

    * time to first token: `t0` to the read that completed the first token event;
    * inter-token latency: the time between two reads that carry tokens, split evenly over
      the token events of the later read (several tokens in one read arrived together);
    * time per output token: (last token - first token) / (output tokens - 1), with the
      engine's `completion_tokens` when it reported usage, else the token events seen.
    """

    __slots__ = (
        "_clock",
        "_events",
        "_finished",
        "_first",
        "_itl",
        "_last",
        "_seen",
        "_t0",
        "_tpot",
        "_ttft",
    )

    def __init__(
        self,
        t0: float,
        ttft: Observe,
        itl: Observe,
        tpot: Observe,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._t0 = t0
        self._ttft, self._itl, self._tpot = ttft, itl, tpot
        self._clock = clock
        self._events = TokenEvents()
        self._first: float | None = None
        self._last = 0.0
        self._seen = 0
        self._finished = False

    @property
    def ttft_s(self) -> float | None:
        return None if self._first is None else self._first - self._t0

    @property
    def token_events(self) -> int:
        return self._seen

    def feed(self, chunk: bytes) -> None:
        n = self._events.feed(chunk)
        if not n:
            return
        now = self._clock()
        if self._first is None:
            self._first = now
            self._ttft(now - self._t0)
        else:
            share = (now - self._last) / n
            observe = self._itl
            for _ in range(n):
                observe(share)
        self._last = now
        self._seen += n

    def finish(self, completion_tokens: int | None = None) -> None:
        """Record time per output token (once; later calls do nothing)."""
        if self._finished:
            return
        self._finished = True
        tokens = completion_tokens if completion_tokens else self._seen
        if self._first is not None and tokens >= 2 and self._last > self._first:
            self._tpot((self._last - self._first) / (tokens - 1))
