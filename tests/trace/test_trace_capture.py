"""Private capture: equal prefixes give equal hashes, and no plaintext reaches the file."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import orjson
import pytest

from gateway.trace.capture import (
    BlockHasher,
    CaptureInput,
    Capturer,
    capture_openai_jsonl,
    load_salt,
    render_prompt,
    salt_id,
)
from gateway.trace.cli import main
from gateway.trace.format import TraceFormatError, read_trace
from gateway.trace.tokenize import ApproxTokenizer

SALT = b"0123456789abcdef-test-salt"
SYSTEM = "You are the assistant of the Zanzibar lighthouse keepers' guild. " * 8
SECRET = "my account number is 99-4471-ZQ and my name is Perpetua Quillfeather"


def _capturer(salt: bytes = SALT, block: int = 16) -> Capturer:
    return Capturer(salt, ApproxTokenizer(), block)


def _chat(*turns: str, user: str | None = None) -> dict[str, object]:
    msgs: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    body: dict[str, object] = {"model": "m", "messages": msgs}
    if user:
        body["user"] = user
    return body


def test_equal_prefixes_equal_hashes_and_lengths() -> None:
    cap = _capturer()
    a = cap.record(CaptureInput(render_prompt(_chat("first question")), 5), 0.0)
    b = cap.record(CaptureInput(render_prompt(_chat("first question", "answer", "second")), 5), 1.0)
    text_a = render_prompt(_chat("first question"))
    assert a.input_tokens == -(-len(text_a) // 4)
    assert a.input_tokens == (len(a.block_hashes) - 1) * 16 + a.last_block_tokens
    full = (len(text_a) // 4) // 16  # whole blocks of a are a prefix of b's text
    assert a.block_hashes[:full] == b.block_hashes[:full]
    assert a.block_hashes[-1] != b.block_hashes[len(a.block_hashes) - 1]


def test_salt_changes_every_hash_and_is_never_in_the_header() -> None:
    text = render_prompt(_chat("hello"))
    a = _capturer(SALT).record(CaptureInput(text, 1), 0.0)
    b = _capturer(SALT + b"x").record(CaptureInput(text, 1), 0.0)
    assert not set(a.block_hashes) & set(b.block_hashes)
    header = _capturer().header
    assert header.salt_id == salt_id(SALT) and len(header.salt_id) == 8
    assert SALT.decode() not in repr(header)


def test_hashes_are_chained() -> None:
    hasher = BlockHasher(SALT, 2)
    x = hasher.hash_blocks([b"aaaa", b"bbbb"])
    y = hasher.hash_blocks([b"cccc", b"bbbb"])
    assert x[1] != y[1]  # same block content, different prefix


def test_capture_file_contains_no_plaintext(tmp_path: Path) -> None:
    entries = [
        {
            "request": _chat(SECRET, user="perpetua@example.com"),
            "timestamp": 1700000000.5,
            "response": {"usage": {"prompt_tokens": 1, "completion_tokens": 42}},
        },
        {
            "request": _chat(SECRET, "Sure.", "And my PIN is 8812"),
            "timestamp": 1700000003.0,
            "headers": {"X-Session-Id": "conversation-secret-77"},
            "response": {"choices": [{"message": {"role": "assistant", "content": "x" * 40}}]},
        },
        {"model": "m", "prompt": SECRET, "max_tokens": 9},
    ]
    src = tmp_path / "requests.jsonl"
    src.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in entries))
    out = tmp_path / "trace.jsonl"
    salt_file = tmp_path / "salt"
    assert (
        main(
            [
                "trace",
                "capture",
                str(src),
                "-o",
                str(out),
                "--salt-file",
                str(salt_file),
                "--block-tokens",
                "16",
            ]
        )
        == 0
    )
    assert stat.S_IMODE(os.stat(salt_file).st_mode) == 0o600
    data = out.read_bytes()
    lowered = data.lower()
    for needle in [
        SECRET,
        "99-4471",
        "Quillfeather",
        "Zanzibar",
        "lighthouse",
        "my pin is",
        "perpetua",
        "conversation-secret",
        "example.com",
        "assistant",
        "user",
    ]:
        assert needle.lower().encode() not in lowered, needle
    assert salt_file.read_bytes().strip() not in data
    # Every word of the inputs longer than 3 characters is absent too.
    words = {
        w for e in entries for w in orjson.dumps(e).decode().replace('"', " ").split() if len(w) > 3
    }
    assert not [w for w in words if w.encode() in data and not w.strip(",:{}[]").isdigit()]

    trace = read_trace(out)
    assert trace.header.salt_id == salt_id(salt_file.read_bytes().strip())
    assert [r.output_tokens for r in trace.records] == [42, 10, 9]
    assert [r.arrival_s for r in trace.records] == [0.0, 2.5, 2.5]
    assert trace.records[0].session_id and trace.records[1].session_id
    assert trace.records[0].session_id != trace.records[1].session_id
    assert trace.records[0].block_hashes[:4] == trace.records[1].block_hashes[:4]


def test_same_salt_file_gives_same_hashes_across_runs(tmp_path: Path) -> None:
    salt_file = tmp_path / "salt"
    first = load_salt(salt_file)
    assert load_salt(salt_file) == first
    with pytest.raises(TraceFormatError):
        load_salt(tmp_path / "missing", create=False)


def test_bad_input_names_the_line() -> None:
    src = io.BytesIO(b'{"model": "m", "messages": []}\n{"model": "m"}\n')
    with pytest.raises(TraceFormatError, match=":2:"):
        capture_openai_jsonl(src, io.BytesIO(), _capturer(), "in.jsonl")


def test_short_salt_rejected() -> None:
    with pytest.raises(TraceFormatError):
        _capturer(b"short")


def test_cli_reports_bad_input_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"not json\n")
    code = main(
        [
            "trace",
            "capture",
            str(src),
            "-o",
            str(tmp_path / "o.jsonl"),
            "--salt-file",
            str(tmp_path / "s"),
        ]
    )
    assert code == 2
    assert "in.jsonl:1" in capsys.readouterr().err
