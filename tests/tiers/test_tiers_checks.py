"""The pure answer checks that decide an escalation."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.tiers.config import Escalation
from gateway.tiers.escalate import failed_check, mean_logprob
from gateway.types import Endpoint

ALL = Escalation()


def answer(content: Any = "Paris.", finish: str = "stop", **message: Any) -> bytes:
    msg = {"role": "assistant", "content": content, **message}
    choice: dict[str, Any] = {"index": 0, "message": msg, "finish_reason": finish}
    if "logprobs" in message:
        choice["logprobs"] = msg.pop("logprobs")
    return orjson.dumps({"choices": [choice]})


SCHEMA = {
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "a", "schema": {"type": "object", "required": ["city"]}},
    }
}


@pytest.mark.parametrize(
    ("status", "payload", "request_body", "expect"),
    [
        (200, answer(), {}, None),
        (200, answer(finish="length"), {}, "length"),
        (200, answer(finish="content_filter"), {}, "content_filter"),
        (200, answer(""), {}, "empty"),
        (200, answer(None, tool_calls=[{"id": "1"}]), {}, None),
        (200, answer("I'm sorry, but I can't help with that."), {}, "refusal"),
        (200, answer("I\u2019m unable to do that"), {}, "refusal"),
        (200, answer("ok", refusal="no"), {}, "refusal"),
        (200, answer("not json"), {"response_format": {"type": "json_object"}}, "json"),
        (200, answer("[1]"), {"response_format": {"type": "json_object"}}, "json"),
        (200, answer('{"a": 1}'), {"response_format": {"type": "json_object"}}, None),
        (200, answer('{"a": 1}'), SCHEMA, "json"),
        (200, answer('{"city": "Oslo"}'), SCHEMA, None),
        (
            200,
            answer("x", logprobs={"content": [{"logprob": -4.0}, {"logprob": -3.0}]}),
            {},
            "logprob",
        ),
        (200, answer("x", logprobs={"content": [{"logprob": -0.1}]}), {}, None),
        (503, b"{}", {}, "error"),
        (429, b"{}", {}, "error"),
        (400, b"{}", {}, None),  # the client's mistake: a bigger model would not fix it
        (200, b"not json", {}, "error"),
        (200, orjson.dumps({"choices": []}), {}, "empty"),
    ],
)
def test_checks(
    status: int, payload: bytes, request_body: dict[str, Any], expect: str | None
) -> None:
    assert failed_check(ALL, Endpoint.CHAT, status, payload, request_body) == expect


def test_only_the_configured_checks_run() -> None:
    only_length = Escalation(checks=("length",), on_error=False)
    assert failed_check(only_length, Endpoint.CHAT, 200, answer(""), {}) is None
    assert failed_check(only_length, Endpoint.CHAT, 503, b"", {}) is None
    assert failed_check(only_length, Endpoint.CHAT, 200, answer(finish="length"), {}) == "length"


def test_completions_and_other_routes() -> None:
    text = orjson.dumps({"choices": [{"text": "", "finish_reason": "stop"}]})
    assert failed_check(ALL, Endpoint.COMPLETIONS, 200, text, {}) == "empty"
    assert failed_check(ALL, Endpoint.EMBEDDINGS, 200, b'{"data": []}', {}) is None
    assert mean_logprob({"token_logprobs": [-1.0, None, -3.0]}) == -2.0
    assert mean_logprob(None) is None
