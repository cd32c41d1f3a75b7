"""The error tree's renderers: one error, told in each dialect a route speaks."""

from __future__ import annotations

import math

import orjson
import pytest

from gateway.errors import (
    BadRequest,
    GatewayError,
    NoHealthyReplica,
    PayloadTooLarge,
    RateLimited,
    UpstreamStalled,
    anthropic_body,
    error_response_parts,
    stream_error_event,
)

ANTHROPIC_KINDS = {
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "overloaded_error",
    "timeout_error",
}


def _data(event: bytes) -> dict[str, object]:
    lines = event.decode().split("\n")
    assert event.endswith(b"\n\n")
    payload = [ln.removeprefix("data: ") for ln in lines if ln.startswith("data: ")]
    assert len(payload) == 1
    parsed: dict[str, object] = orjson.loads(payload[0])
    return parsed


def test_openai_stream_event_carries_the_same_object_as_the_json_body() -> None:
    err = BadRequest("bad field", param="messages")
    event = stream_error_event(err)
    assert event.startswith(b"data: ")
    assert _data(event) == orjson.loads(err.body())


@pytest.mark.parametrize(
    ("last", "expected"),
    [
        (b"", 0),
        (b'event: response.output_text.delta\ndata: {"sequence_number": 6}\n\n', 7),
        (b'data: {"sequence_number":1}\n\ndata: {"sequence_number": 41}\n\n', 42),
    ],
)
def test_responses_error_event_is_numbered_after_the_last_event(last: bytes, expected: int) -> None:
    err = UpstreamStalled("replica r0 stalled")
    event = stream_error_event(err, "responses", last)
    assert event.startswith(b"event: error\n")
    data = _data(event)
    assert data["type"] == "error" and data["sequence_number"] == expected
    assert data["message"] == err.message
    # No code on the class: the type stands in for it, never null.
    assert data["code"] == (err.code or err.error_type) and data["code"]


@pytest.mark.parametrize("err", [PayloadTooLarge("big"), RateLimited("slow"), GatewayError("x")])
def test_anthropic_shape_on_the_stream_and_in_the_body_agree(err: GatewayError) -> None:
    event = stream_error_event(err, "anthropic")
    assert event.startswith(b"event: error\n")
    assert _data(event) == orjson.loads(anthropic_body(err))
    body = orjson.loads(anthropic_body(err))
    assert body["type"] == "error" and body["error"]["message"] == err.message
    # The Messages API's own kinds, never OpenAI's type names ("server_error").
    assert body["error"]["type"] in ANTHROPIC_KINDS


@pytest.mark.parametrize("shape", ["openai", "anthropic"])
def test_response_parts_are_consistent_http(shape: str) -> None:
    err = NoHealthyReplica("none", retry_after_s=3)
    status, headers, body = error_response_parts(err, shape)  # type: ignore[arg-type]
    assert status == 503
    named = dict(headers)
    assert int(named[b"content-length"]) == len(body)
    assert named[b"content-type"] == b"application/json"
    assert named[b"retry-after"] == b"3"
    assert all(k == k.lower() for k, _ in headers)
    orjson.loads(body)


@pytest.mark.parametrize("wait", [0.0, 0.0004, 0.2, 1.0, 2.5, 7.9])
def test_rate_limited_never_asks_for_less_than_the_wait(wait: float) -> None:
    headers = RateLimited("slow", retry_after_s=wait).headers
    seconds = int(headers["retry-after"])
    assert seconds >= 1 and seconds >= math.ceil(wait - 1e-9)
    assert int(headers["retry-after-ms"]) == int(wait * 1000)
