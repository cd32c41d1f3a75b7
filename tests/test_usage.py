from __future__ import annotations

import orjson

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


def test_responses_and_anthropic_usage() -> None:
    responses_tail = (
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"x"}\n\n'
        b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"resp_1",'
        b'"usage":{"input_tokens":120,"input_tokens_details":{"cached_tokens":64},"output_tokens":7}}}\n\n'
    )
    assert usage_tokens(usage_from_sse(responses_tail)) == (120, 64, 7)
    anthropic_tail = (
        b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
        b'"usage":{"input_tokens":20,"cache_read_input_tokens":100,"output_tokens":9}}\n\n'
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )
    assert usage_tokens(usage_from_sse(anthropic_tail)) == (120, 100, 9)
    message = b'{"type":"message","usage":{"input_tokens":5,"output_tokens":2}}'
    assert usage_tokens(usage_from_json(message)) == (5, None, 2)


def test_sglang_native_meta_info() -> None:
    # SGLang's /generate answer: token counts in `meta_info`, the cached ones as a plain
    # `cached_tokens` (HiCache adds a per-tier `cached_tokens_details` beside it).
    body = {
        "text": " Paris.",
        "meta_info": {
            "id": "e7",
            "prompt_tokens": 5,
            "completion_tokens": 32,
            "cached_tokens": 2,
            "cached_tokens_details": {"device": 2, "host": 0},
        },
    }
    assert usage_tokens(usage_from_json(orjson.dumps(body))) == (5, 2, 32)
    tail = b"data: " + orjson.dumps(body) + b"\n\ndata: [DONE]\n\n"
    assert usage_tokens(usage_from_sse(tail)) == (5, 2, 32)
    assert usage_tokens(usage_from_json(b'{"meta_info": {"id": "x"}}')) == (None, None, None)
