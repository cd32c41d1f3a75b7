from __future__ import annotations

from typing import Any

import pytest

from gateway.body import ClientGone, check_content_type, parse_json, read_body, validate
from gateway.errors import BadRequest, InvalidJSON, PayloadTooLarge, UnsupportedMediaType
from gateway.types import Endpoint


def receiver(*messages: dict[str, Any]):  # type: ignore[no-untyped-def]
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        return queue.pop(0)

    return receive


async def test_read_body_joins_chunks_and_enforces_limit() -> None:
    rx = receiver(
        {"type": "http.request", "body": b"ab", "more_body": True},
        {"type": "http.request", "body": b"c"},
    )
    assert await read_body(rx, 10, None) == b"abc"
    with pytest.raises(PayloadTooLarge):
        await read_body(receiver({"type": "http.request", "body": b"x" * 11}), 10, None)
    with pytest.raises(PayloadTooLarge):
        await read_body(receiver(), 10, 11)  # declared length refused before reading
    chunks = [{"type": "http.request", "body": b"x" * 6, "more_body": True}] * 2
    with pytest.raises(PayloadTooLarge):
        await read_body(receiver(*chunks), 10, None)
    with pytest.raises(ClientGone):
        await read_body(receiver({"type": "http.disconnect"}), 10, None)


@pytest.mark.parametrize(
    "value",
    [None, b"application/json", b"application/json; charset=utf-8", b"application/vnd.x+json"],
)
def test_content_type_accepted(value: bytes | None) -> None:
    check_content_type(value)


@pytest.mark.parametrize(
    "value", [b"text/plain", b"multipart/form-data; boundary=x", b"application/xml"]
)
def test_content_type_refused(value: bytes) -> None:
    with pytest.raises(UnsupportedMediaType):
        check_content_type(value)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"[1, 2]",
        b'"s"',
        b'{"a": "\xff"}',
        b'{"a": 1e999}',
        b'{"a": NaN}',
        b"\x00\x01",
        b"null",
    ],
)
def test_parse_json_refuses_malformed(raw: bytes) -> None:
    with pytest.raises(InvalidJSON):
        parse_json(raw, 64)


def test_parse_json_depth() -> None:
    deep = b'{"a": ' + b"[" * 100 + b"]" * 100 + b"}"
    with pytest.raises(BadRequest):
        parse_json(deep, 64)
    wide = b'{"a": [' + b",".join([b"[]"] * 500) + b"]}"
    assert parse_json(wide, 64)["a"][0] == []
    very_deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(InvalidJSON):
        parse_json(very_deep, 64)


def _nested(depth: int, pad: int = 0) -> bytes:
    """A body whose deepest container sits at `depth` (the body itself is level 1), padded
    with a long string so that it can be made larger than the counting threshold."""
    inner = b"[" * (depth - 1) + b"]" * (depth - 1)
    return b'{"pad": "' + b"x" * pad + b'", "a": ' + inner + b"}"


@pytest.mark.parametrize("pad", [0, 64 * 1024])  # counted first, and walked at once
@pytest.mark.parametrize("limit", [4, 64, 199, 200, 201, 500])  # recursive and iterative
def test_parse_json_depth_limit_is_exact(pad: int, limit: int) -> None:
    assert parse_json(_nested(limit, pad), limit)["a"] is not None
    with pytest.raises(BadRequest):
        parse_json(_nested(limit + 1, pad), limit)


def test_large_bodies_keep_the_depth_limit() -> None:
    # 100K token ids, and a long chat with one message nested too deep at its very end.
    ids = b'{"model": "m", "prompt": [' + b",".join(b"%d" % i for i in range(100_000)) + b"]}"
    assert len(parse_json(ids, 64)["prompt"]) == 100_000
    message = b'{"role": "user", "content": "' + b"y" * 1000 + b'"}'
    chat = b'{"model": "m", "messages": [' + b",".join([message] * 400)
    assert parse_json(chat + b"]}", 64)["messages"][399]["role"] == "user"
    deep = chat + b', {"role": "user", "content": [' + b"[" * 70 + b"]" * 70 + b"]}]}"
    with pytest.raises(BadRequest):
        parse_json(deep, 64)


def test_huge_numbers_parse_or_fail_cleanly() -> None:
    assert isinstance(parse_json(b'{"a": 123456789012345678901234567890}', 64)["a"], (int, float))


GOOD_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": 3, "messages": []}, "model"),
        ({"model": "", "messages": []}, "model"),
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": ["hi"]}, "messages.0"),
        ({"model": "m", "messages": [{"content": "x"}]}, "messages.0.role"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({**GOOD_CHAT, "stream": "yes"}, "stream"),
        ({**GOOD_CHAT, "max_tokens": "10"}, "max_tokens"),
        ({**GOOD_CHAT, "max_tokens": 1e300}, "max_tokens"),
        ({**GOOD_CHAT, "max_tokens": 10**30}, "max_tokens"),
        ({**GOOD_CHAT, "max_tokens": True}, "max_tokens"),
        ({**GOOD_CHAT, "n": -1}, "n"),
    ],
)
def test_validate_chat_errors_name_the_param(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as info:
        validate(body, Endpoint.CHAT)
    assert info.value.param == param


@pytest.mark.parametrize("prompt", ["x", ["a", "b"], [1, 2], [[1], [2, 3]]])
def test_validate_prompt_shapes(prompt: Any) -> None:
    assert validate({"model": "m", "prompt": prompt}, Endpoint.COMPLETIONS) == "m"
    assert validate({"model": "m", "input": prompt}, Endpoint.EMBEDDINGS) == "m"


@pytest.mark.parametrize(
    "prompt",
    [None, 3, [], [1, "a"], [[]], {"a": 1}, [True], [1, True], [[1, 2], [3, False]], [1.0]],
)
def test_validate_prompt_errors(prompt: Any) -> None:
    with pytest.raises(BadRequest) as info:
        validate({"model": "m", "prompt": prompt}, Endpoint.COMPLETIONS)
    assert info.value.param == "prompt"


def test_validate_ok() -> None:
    assert validate({**GOOD_CHAT, "stream": True, "max_tokens": 5}, Endpoint.CHAT) == "m"


def test_a_body_without_model_is_valid_and_names_none() -> None:
    """vLLM serves its one model to such a body; the proxy fills it in (issue 44)."""
    assert validate({"messages": [{"role": "user", "content": "hi"}]}, Endpoint.CHAT) == ""


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        (Endpoint.SCORE, {"data_1": "a", "data_2": ["b", "c"]}),
        (Endpoint.SCORE, {"text_1": "a", "text_2": "b"}),
        (Endpoint.SCORE, {"queries": "a", "items": ["b"]}),
        (Endpoint.SCORE, {"queries": ["a"], "documents": ["b"]}),
        (Endpoint.RERANK, {"query": "a", "documents": "just one"}),
        (
            Endpoint.RERANK,
            {"query": "a", "documents": {"content": [{"type": "text", "text": "b"}]}},
        ),
        (
            Endpoint.RERANK,
            {
                "query": {"content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                "documents": ["b"],
            },
        ),
    ],
)
def test_score_and_rerank_accept_vllms_forms(endpoint: Endpoint, body: dict[str, Any]) -> None:
    assert validate({"model": "m", **body}, endpoint) == "m"


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        (Endpoint.SCORE, {"data_1": "a"}, "text_1"),
        (Endpoint.RERANK, {"query": "", "documents": ["b"]}, "query"),
        (Endpoint.RERANK, {"query": "a", "documents": []}, "documents"),
        (Endpoint.RERANK, {"query": 3, "documents": ["b"]}, "query"),
    ],
)
def test_score_and_rerank_still_refuse_what_vllm_refuses(
    endpoint: Endpoint, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as info:
        validate({"model": "m", **body}, endpoint)
    assert info.value.param == param


def test_new_routes_validate_their_own_fields() -> None:
    from gateway.types import Endpoint as E

    good = [
        (E.RESPONSES, {"model": "m", "input": "hi"}),
        (
            E.RESPONSES,
            {
                "model": "m",
                "previous_response_id": "resp_1",
                "input": [{"role": "user", "content": "x"}],
            },
        ),
        (
            E.MESSAGES,
            {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]},
        ),
        (E.SCORE, {"model": "m", "queries": "a", "documents": ["b"]}),
    ]
    for endpoint, body in good:
        assert validate(body, endpoint) == "m"
    bad = [
        (E.RESPONSES, {"model": "m", "input": []}, "input"),
        (
            E.RESPONSES,
            {"model": "m", "input": "x", "previous_response_id": 3},
            "previous_response_id",
        ),
        (E.MESSAGES, {"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        (E.DETOKENIZE, {"model": "m", "tokens": [1, "a"]}, "tokens"),
        (E.TOKENIZE, {"model": "m"}, "prompt"),
    ]
    for endpoint, body, param in bad:
        with pytest.raises(BadRequest) as info:
            validate(body, endpoint)
        assert info.value.param == param, endpoint
