"""What capture reads from an OpenAI request log: the prompt as rendered (content parts,
tools, tool calls), the output length (usage, else the answer's text, else the request's
cap), the session (by precedence), the arrival (epoch seconds or milliseconds, ISO text),
and where the salt comes from."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.cli import main
from gateway.trace.capture import (
    BlockHasher,
    Capturer,
    capture_openai_jsonl,
    load_salt,
    output_tokens_of,
    render_prompt,
    session_of,
)
from gateway.trace.format import TraceFormatError, parse_kvgate, read_trace
from gateway.trace.tokenize import ApproxTokenizer

SALT = b"0123456789abcdef0123456789abcdef"
TOK = ApproxTokenizer()


def capturer(block_tokens: int = 4) -> Capturer:
    return Capturer(SALT, TOK, block_tokens)


def test_content_parts_render_text_and_a_marker_per_media_part() -> None:
    parts = [
        {"type": "text", "text": "look at "},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        " and ",
        {"type": "input_audio"},
        7,
    ]
    text = render_prompt({"messages": [{"role": "user", "content": parts}]})
    assert text == "<|user|>\nlook at [image_url] and [input_audio]\n<|assistant|>\n"
    assert "base64" not in text
    odd = render_prompt({"messages": [{"role": "tool", "content": {"b": 1, "a": 2}}, "junk"]})
    assert odd == '<|tool|>\n{"a":2,"b":1}\n<|assistant|>\n'


def test_tools_and_tool_calls_are_part_of_the_prompt() -> None:
    tools = [{"type": "function", "function": {"name": "grep", "parameters": {}}}]
    calls = [{"id": "c1", "type": "function", "function": {"name": "grep", "arguments": "{}"}}]
    messages = [
        {"role": "user", "content": "find it"},
        {"role": "assistant", "content": None, "tool_calls": calls},
    ]
    with_tools = render_prompt({"messages": messages, "tools": tools})
    assert with_tools.startswith("<|tools|>\n[{")
    assert '"name":"grep"' in with_tools and with_tools.count("grep") == 2
    without = render_prompt({"messages": messages})
    # The tool specs come first, so they change every block after them.
    c = capturer()
    a, b = (
        c.record(c.from_openai({"messages": messages, "tools": tools}), 0.0),
        c.record(c.from_openai({"messages": messages}), 0.0),
    )
    assert a.block_hashes[0] != b.block_hashes[0]
    assert TOK.count(with_tools) > TOK.count(without)


def test_completion_prompts() -> None:
    assert render_prompt({"prompt": ["ab", "cd"]}) == "abcd"
    assert render_prompt({"prompt": 12}) == "12"
    assert render_prompt({"model": "m"}) == ""


@pytest.mark.parametrize(
    ("request_body", "response", "tokens"),
    [
        ({"max_tokens": 9}, {"usage": {"completion_tokens": 5}}, 5),
        ({"max_tokens": 9}, {"choices": [{"message": {"content": "x" * 40}}]}, 10),
        ({"max_tokens": 9}, {"choices": [{"text": "y" * 12}, "junk"]}, 3),
        ({"max_tokens": 9, "max_completion_tokens": 7}, None, 7),
        ({"max_tokens": 9}, {"choices": []}, 9),
        ({}, None, 0),
    ],
)
def test_output_tokens_by_precedence(
    request_body: dict[str, Any], response: dict[str, Any] | None, tokens: int
) -> None:
    assert output_tokens_of(request_body, response, TOK) == tokens


@pytest.mark.parametrize(
    ("entry", "request_body", "session"),
    [
        ({"session_id": "a", "headers": {"X-Session-Id": "b"}}, {"user": "d"}, "a"),
        ({"headers": {"X-SESSION-ID": "b"}}, {"prompt_cache_key": "c", "user": "d"}, "b"),
        ({"headers": ["not", "a", "map"]}, {"prompt_cache_key": "c", "user": "d"}, "c"),
        ({}, {"user": "d"}, "d"),
        ({"session_id": ""}, {"user": 5}, None),
    ],
)
def test_session_by_precedence(
    entry: dict[str, Any], request_body: dict[str, Any], session: str | None
) -> None:
    assert session_of(entry, request_body) == session


def capture(entries: list[Any], block_tokens: int = 4) -> list[tuple[float, int]]:
    src = io.BytesIO(b"".join(orjson.dumps(e) + b"\n" for e in entries))
    dst = io.BytesIO()
    n = capture_openai_jsonl(src, dst, capturer(block_tokens))
    trace = parse_kvgate(dst.getvalue().splitlines(keepends=True))
    assert n == len(trace.records)
    return [(r.arrival_s, r.output_tokens) for r in trace.records]


def test_arrivals_from_every_timestamp_form() -> None:
    body = {"prompt": "hello there", "max_tokens": 1}
    entries = [
        {"request": {**body, "max_tokens": 1}, "timestamp": 1_700_000_000},  # epoch seconds
        {"request": {**body, "max_tokens": 2}, "timestamp": 1_700_000_002_500},  # epoch ms
        {"request": {**body, "max_tokens": 3}, "timestamp": "2023-11-14T22:13:21Z"},  # ISO
        {"request": {**body, "max_tokens": 4}},  # none: the previous entry's time
        {"request": {**body, "max_tokens": 5}, "timestamp": True},  # not a time
        {"request": {**body, "max_tokens": 6}, "timestamp": "last tuesday"},
        {
            "request": {**body, "max_tokens": 7},
            "response": {"created": 1_700_000_000.25, "usage": {"completion_tokens": 7}},
        },
    ]
    # 2023-11-14T22:13:21Z is epoch 1,700,000,001. Entries without a usable time take the
    # previous one's; the output is sorted by time, then by line.
    assert capture(entries) == [
        (0.0, 1),
        (0.25, 7),
        (1.0, 3),
        (1.0, 4),
        (1.0, 5),
        (1.0, 6),
        (2.5, 2),
    ]


def test_no_timestamps_at_all_keep_the_file_order() -> None:
    entries = [{"prompt": "a" * 10, "max_tokens": n} for n in (3, 1, 2)]
    assert capture(entries) == [(0.0, 3), (0.0, 1), (0.0, 2)]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b"{half\n", "x:2: not JSON"),
        (b"[1, 2]\n", "x:2: expected a JSON object"),
        (b'{"request": "text"}\n', "x:2: entry has no OpenAI request"),
    ],
)
def test_bad_lines_are_named(line: bytes, message: str) -> None:
    src = io.BytesIO(b'{"prompt": "fine"}\n' + line)
    with pytest.raises(TraceFormatError, match=message):
        capture_openai_jsonl(src, io.BytesIO(), capturer(), "x")


def test_block_tokens_must_be_positive() -> None:
    with pytest.raises(TraceFormatError, match="block_tokens must be positive"):
        BlockHasher(SALT, 0)


def test_salt_from_the_environment_gives_stable_hashes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "r.jsonl"
    src.write_text('{"prompt": "' + "same words " * 20 + '", "max_tokens": 2}\n')
    monkeypatch.setenv("KVGATE_TRACE_SALT", "an environment salt of some length")
    assert load_salt(None) == b"an environment salt of some length"
    runs = []
    for n in range(2):
        out = tmp_path / f"t{n}.jsonl"
        assert main(["trace", "capture", str(src), "-o", str(out)]) == 0
        assert "random salt" not in capsys.readouterr().err
        runs.append(read_trace(out))
    assert runs[0].records == runs[1].records and runs[0].header.salt_id == runs[1].header.salt_id
    # Without a salt file or the variable: a warning, and hashes no other run shares.
    monkeypatch.delenv("KVGATE_TRACE_SALT")
    out = tmp_path / "random.jsonl"
    assert main(["trace", "capture", str(src), "-o", str(out)]) == 0
    assert "using a random salt for this run only" in capsys.readouterr().err
    assert read_trace(out).records[0].block_hashes != runs[0].records[0].block_hashes
    # A capture into a folder that does not exist is one line, exit 2.
    assert main(["trace", "capture", str(src), "-o", str(tmp_path / "no" / "t.jsonl")]) == 2
    assert "No such file or directory" in capsys.readouterr().err


def test_a_prompt_of_token_ids_is_counted_and_hashed_by_its_ids() -> None:
    c = capturer(block_tokens=16)
    ids = list(range(1000, 1040))
    a = c.record(c.from_openai({"prompt": ids, "max_tokens": 2}), 0.0)
    b = c.record(c.from_openai({"prompt": [*ids, 7, 8], "max_tokens": 2}), 0.0)
    assert (a.input_tokens, a.last_block_tokens, len(a.block_hashes)) == (40, 8, 3)
    assert a.block_hashes[:2] == b.block_hashes[:2] and a.block_hashes[2] != b.block_hashes[2]
    # Hashed as a tokenizer.json's ids are (4 bytes each): the same ids, the same hashes.
    payloads = [
        b"".join(i.to_bytes(4, "little") for i in ids[k : k + 16]) for k in range(0, 40, 16)
    ]
    assert BlockHasher(SALT, 16).hash_blocks(payloads) == a.block_hashes
    # Not token ids: rendered as text, as before.
    for prompt in ([True, False], [1, "two"], [-1, 2], []):
        item = c.from_openai({"prompt": prompt})
        assert item.token_ids is None
