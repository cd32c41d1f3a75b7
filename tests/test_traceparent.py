"""W3C traceparent: parsing and the header the next hop gets (gateway.traceparent)."""

from __future__ import annotations

import pytest

from gateway.traceparent import child, new_span_id, parse

TRACE = b"4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = b"00f067aa0ba902b7"
VALID = b"00-" + TRACE + b"-" + PARENT + b"-01"


def test_a_valid_header_is_parsed() -> None:
    tp = parse(VALID)
    assert tp is not None and (tp.trace_id, tp.parent_id, tp.flags) == (TRACE, PARENT, 1)
    assert tp.sampled and tp.header() == VALID


@pytest.mark.parametrize(
    "value",
    [
        None,
        b"",
        b"garbage",
        VALID[:-1],  # too short
        VALID + b"0",  # version 00 has exactly 55 characters
        VALID.upper(),  # hex is lower-case
        b"ff" + VALID[2:],  # version ff is invalid
        b"00-" + b"0" * 32 + b"-" + PARENT + b"-01",  # all-zero trace id
        b"00-" + TRACE + b"-" + b"0" * 16 + b"-01",  # all-zero parent id
        b"00_" + VALID[3:],
        b"00-" + TRACE + b"-" + PARENT + b"-0g",
        b"01-" + TRACE + b"-" + PARENT + b"-01x",  # later version: extra fields after a dash
    ],
)
def test_invalid_headers_are_refused(value: bytes | None) -> None:
    assert parse(value) is None


def test_a_later_version_with_extra_fields_is_read_as_00() -> None:
    tp = parse(b"cc-" + TRACE + b"-" + PARENT + b"-00-what-comes-next")
    assert tp is not None and tp.trace_id == TRACE and not tp.sampled


def test_the_child_keeps_trace_and_flags_and_replaces_the_parent() -> None:
    out = parse(child(VALID))
    assert out is not None
    assert out.trace_id == TRACE and out.flags == 1 and out.parent_id != PARENT
    unsampled = parse(child(VALID[:-2] + b"00", b"1111111111111111"))
    assert unsampled is not None
    assert unsampled.parent_id == b"1111111111111111" and not unsampled.sampled


@pytest.mark.parametrize("incoming", [None, b"nonsense", VALID.upper()])
def test_without_a_valid_header_a_new_sampled_trace_starts(incoming: bytes | None) -> None:
    a, b = parse(child(incoming)), parse(child(incoming))
    assert a is not None and b is not None
    assert a.sampled and a.trace_id != b.trace_id and a.trace_id != TRACE


def test_span_ids_are_16_hex_digits_and_differ() -> None:
    ids = {new_span_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(len(i) == 16 and int(i, 16) for i in ids)
