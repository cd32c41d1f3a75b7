"""Usage for every streamed request, including the ones whose client did not ask for it.

Engines only report token usage on a stream when `stream_options.include_usage` is set, and
most clients never set it, so the observers (cost per token, trace capture, admission's
output history) would miss most real traffic. When observers exist, the proxy sets the flag
on the upstream body itself (`inject_usage`, once, before the body bytes are finalised for
the plain forward, the admission rewrite and the PD hand-off alike) and removes the extra
usage-only event from what the client receives (`UsageStripper`).

Decision on `"usage": null`: with the flag set, vLLM also writes `"usage":null` into every
other chunk. Those fields are passed through untouched: rewriting each chunk would cost a
parse per token and break byte-identity of everything else, OpenAI's own API emits the same
null field whenever include_usage is set, and the SDKs model `usage` as optional on chunks.

`continuous_usage_stats` (vLLM): when the client sets it, every chunk carries usage anyway
once include_usage is on, so the flag is set (the client's option only works with it) and
nothing is stripped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

# A usage-only event is a few hundred bytes. A trailing fragment larger than this cannot be
# one, so it is sent on at once instead of being held (bounds both memory and delay).
MAX_HELD_BYTES = 16384

_MARKERS = (b'"usage":{', b'"usage": {')
_USAGE_OPTION = b'"stream_options":{"include_usage":true},'


def inject_usage(body: Mapping[str, Any]) -> tuple[dict[str, Any], bool] | None:
    """(body to forward, strip the usage event) when the gateway must ask for usage itself.

    None leaves the request alone: not streaming, the client asked for usage already, or
    `stream_options` is malformed (the engine's own 400 is the right answer to that).
    """
    if body.get("stream") is not True:
        return None
    options = body.get("stream_options")
    if options is None:
        options = {}
    elif not isinstance(options, dict) or options.get("include_usage"):
        return None
    strip = not options.get("continuous_usage_stats")
    return {**body, "stream_options": {**options, "include_usage": True}}, strip


def with_usage_option(body: Mapping[str, Any], raw: bytes) -> bytes | None:
    """`raw` (the bytes of `body`) asking for usage, without serialising the body again: when
    the body has no `stream_options` at all, the field is written at the head of the object,
    so the cost does not grow with the prompt. None when that cannot be done (the caller
    serialises the body `inject_usage` returned)."""
    if "stream_options" in body or not body:
        return None
    start = 0 if raw[:1] == b"{" else len(raw) - len(raw.lstrip())
    if raw[start : start + 1] != b"{":
        return None
    return b"".join((raw[: start + 1], _USAGE_OPTION, memoryview(raw)[start + 1 :]))


def _last_boundary_end(data: bytes) -> int:
    """Offset just past the last SSE event boundary in `data`; 0 when there is none."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def _first_boundary_end(data: bytes, start: int = 0) -> int:
    """Offset just past the first SSE event boundary at or after `start`; -1 when none."""
    lf = data.find(b"\n\n", start)
    crlf = data.find(b"\r\n\r\n", start)
    ends = [i + n for i, n in ((lf, 2), (crlf, 4)) if i >= 0]
    return min(ends) if ends else -1


def _event_start(data: bytes, pos: int) -> int:
    lf = data.rfind(b"\n\n", 0, pos)
    crlf = data.rfind(b"\r\n\r\n", 0, pos)
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def _usage_only(event: bytes) -> dict[str, Any] | None:
    """The usage of a single-line `data:` event with `"choices": []`, else None."""
    line = event.strip()
    if not line.startswith(b"data:") or b"\n" in line or b"\r" in line:
        return None
    try:
        data = orjson.loads(line[5:])
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict) or data.get("choices") != []:
        return None
    usage = data.get("usage")
    return usage if isinstance(usage, dict) else None


class UsageStripper:
    """Removes the usage-only SSE event from a stream and keeps its `usage`.

    `feed` returns the bytes to send now: every complete event at once, byte for byte,
    holding back only an incomplete trailing fragment (upstream chunks need not end on an
    event boundary, and an event must be whole to be recognised). `flush` returns what is
    still held when the stream ends. After the usage event went by, chunks pass untouched.
    """

    __slots__ = ("_held", "_passing", "usage")

    def __init__(self) -> None:
        self._held = b""
        # Inside an oversized event whose start was already sent: send up to its end.
        self._passing = False
        self.usage: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> bytes:
        if self.usage is not None:
            return chunk
        data = self._held + chunk if self._held else chunk
        self._held = b""
        head = b""
        if self._passing:
            end = _first_boundary_end(data)
            if end < 0:
                return data
            self._passing = False
            head, data = data[:end], data[end:]
        cut = _last_boundary_end(data)
        complete, rest = data[:cut], data[cut:]
        if complete and (_MARKERS[0] in complete or _MARKERS[1] in complete):
            complete = self._strip(complete)
            if self.usage is not None:
                return head + complete + rest
        if len(rest) > MAX_HELD_BYTES:
            self._passing = True
            return head + complete + rest
        self._held = rest
        return head + complete if head else complete

    def flush(self) -> bytes:
        held, self._held = self._held, b""
        return held

    def _strip(self, complete: bytes) -> bytes:
        """`complete` without its first usage-only event (sets `self.usage`)."""
        pos = 0
        while True:
            found = [i for i in (complete.find(m, pos) for m in _MARKERS) if i >= 0]
            if not found:
                return complete
            at = min(found)
            start = _event_start(complete, at)
            end = _first_boundary_end(complete, at)
            usage = _usage_only(complete[start:end])
            if usage is not None:
                self.usage = usage
                return complete[:start] + complete[end:]
            pos = end
