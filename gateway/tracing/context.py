"""W3C Trace Context (`traceparent`), the pure part: parse, and make the header an engine gets.

`traceparent: 00-<trace id, 32 hex>-<parent id, 16 hex>-<flags, 2 hex>`. The gateway is a
hop of the trace: it keeps the caller's trace id and flags and puts its own span id in the
parent field, so the engine's spans hang under the gateway's. A request without a valid
header starts a trace here, sampled (flags 01) so that engines tracing with a parent-based
sampler record it. `tracestate` is relayed unchanged (the gateway adds no entry of its own).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

TRACEPARENT = b"traceparent"
TRACESTATE = b"tracestate"
SAMPLED = 0x01
_HEX = frozenset(b"0123456789abcdef")
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


def _hex(part: bytes) -> bool:
    return _HEX.issuperset(part)


def parse(value: bytes | None) -> TraceParent | None:
    """The header's fields, or None for a missing or invalid one (which starts a new trace).

    Version 00 must be exactly 55 characters; a later version may append fields after a
    dash (they are ignored, and the header is passed on as version 00). Version ff, upper-
    case hex and all-zero ids are invalid.
    """
    if value is None or len(value) < 55:
        return None
    value = value.strip()
    version = value[:2]
    if len(value) < 55 or not _hex(version) or version == b"ff":
        return None
    if version == b"00" and len(value) != 55:
        return None
    if len(value) > 55 and value[55:56] != b"-":
        return None
    if value[2:3] != b"-" or value[35:36] != b"-" or value[52:53] != b"-":
        return None
    trace_id, parent_id, flags = value[3:35], value[36:52], value[53:55]
    if not (_hex(trace_id) and _hex(parent_id) and _hex(flags)):
        return None
    if trace_id == _ZERO_TRACE or parent_id == _ZERO_SPAN:
        return None
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
    parent = parse(incoming)
    if parent is None:
        return b"00-%s-%s-01" % (new_trace_id(), span)
    return b"00-%s-%s-%02x" % (parent.trace_id, span, parent.flags)
