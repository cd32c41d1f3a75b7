from __future__ import annotations

from gateway.usage import usage_from_json, usage_from_sse, usage_tokens

FINAL = (
    b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"!"}}],"usage":null}\n\n'
    b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":1540,"total_tokens":1542,'
    b'"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":1536}}}\n\n'
    b"data: [DONE]\n\n"
)


def test_stream_tail_final_usage_chunk() -> None:
    usage = usage_from_sse(FINAL)
    assert usage_tokens(usage) == (1540, 1536, 2)


def test_stream_without_usage() -> None:
    tail = b'data: {"choices":[],"usage":null}\n\ndata: [DONE]\n\n'
    assert usage_from_sse(tail) is None
    assert usage_from_sse(b"") is None
    assert usage_from_sse(b'data: {"usage":{broken\n\n') is None


def test_json_body() -> None:
    body = b'{"usage": {"prompt_tokens": 5, "completion_tokens": 1}}'
    assert usage_tokens(usage_from_json(body)) == (5, None, 1)
    assert usage_from_json(b"not json") is None and usage_from_json(b"[1]") is None
    assert usage_tokens({"prompt_tokens": "5", "completion_tokens": True}) == (None, None, None)
    assert usage_tokens(None) == (None, None, None)
