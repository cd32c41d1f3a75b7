"""W3C Trace Context (`traceparent`), the pure part: parse, and make the header an engine gets.

Wire vocabulary on the ground floor: the inbound stage propagates the header with or without
spans, and gateway.tracing builds its spans on it; neither imports the other.

`traceparent: 00-<trace id, 32 hex>-<parent id, 16 hex>-<flags, 2 hex>`. The gateway is a
hop of the trace: it keeps the caller's trace id and flags and puts its own span id in the
parent field, so the engine's spans hang under the gateway's. A request without a valid
header starts a trace here, sampled (flags 01) so that engines tracing with a parent-based
sampler record it. `tracestate` is relayed unchanged (the gateway adds no entry of its own).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

TRACEPARENT = b"traceparent"
TRACESTATE = b"tracestate"
SAMPLED = 0x01
_TRACEPARENT = re.compile(
    rb"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.DOTALL
)
_ZERO_TRACE = b"0" * 32
_ZERO_SPAN = b"0" * 16


@dataclass(frozen=True, slots=True)
class TraceParent:
    trace_id: bytes  # 32 lower-case hex digits
    parent_id: bytes  # 16
    flags: int

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED)

    def header(self) -> bytes:
        return b"00-%s-%s-%02x" % (self.trace_id, self.parent_id, self.flags)


def _fields(value: bytes | None) -> tuple[bytes, bytes, bytes] | None:
    if value is None:
        return None
    m = _TRACEPARENT.fullmatch(value.strip())
    if m is None:
        return None
    version, trace_id, parent_id, flags, rest = m.groups()
    if version == b"ff" or (version == b"00" and rest):
        return None
    if trace_id == _ZERO_TRACE or parent_id == _ZERO_SPAN:
        return None
    return trace_id, parent_id, flags


def parse(value: bytes | None) -> TraceParent | None:
    """The header's fields, or None for a missing or invalid one (which starts a new trace).

    Version 00 must be exactly 55 characters; a later version may append fields after a
    dash (they are ignored, and the header is passed on as version 00). Version ff, upper-
    case hex and all-zero ids are invalid.
    """
    fields = _fields(value)
    if fields is None:
        return None
    trace_id, parent_id, flags = fields
    return TraceParent(trace_id, parent_id, int(flags, 16))


def new_span_id() -> bytes:
    # Not secret, only unique: the OpenTelemetry SDK draws its ids the same way.
    while True:
        n = random.getrandbits(64)
        if n:
            return b"%016x" % n


def new_trace_id() -> bytes:
    while True:
        n = random.getrandbits(128)
        if n:
            return b"%032x" % n


def child(incoming: bytes | None, span_id: bytes | None = None) -> bytes:
    """The `traceparent` for the next hop: `incoming`'s trace with `span_id` (a new one by
    default) as its parent, or a new sampled trace when `incoming` is missing or invalid."""
    span = span_id if span_id is not None else new_span_id()
    fields = _fields(incoming)
    if fields is None:
        return b"00-%s-%s-01" % (new_trace_id(), span)
    return b"00-%s-%s-%s" % (fields[0], span, fields[2])
