"""Round trips of the kvgate trace format and the Mooncake/Azure converters."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from gateway.trace.format import (
    Rechunker,
    Trace,
    TraceFormatError,
    TraceHeader,
    TraceRecord,
    mooncake_lines,
    read_trace,
    write_mooncake,
    write_trace,
)

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "traces"

MOONCAKE = [
    {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
    {"timestamp": 250, "input_length": 1030, "output_length": 7, "hash_ids": [0, 1, 3]},
    {"timestamp": 1000, "input_length": 512, "output_length": 1, "hash_ids": [4]},
]


def _write_lines(path: Path, objs: list[dict[str, object]]) -> None:
    path.write_bytes(b"".join(orjson.dumps(o) + b"\n" for o in objs))


def test_kvgate_round_trip(tmp_path: Path) -> None:
    trace = Trace(
        TraceHeader(block_tokens=4, tokenizer="approx-4cpt", salt_id="abcd0123", source="capture"),
        (
            TraceRecord(0.0, 10, 3, (2**64 - 1, 7, 9), 2, "s1"),
            TraceRecord(1.5, 4, 0, (2**64 - 1,), 4, None),
            TraceRecord(2.25, 0, 9),
        ),
    )
    path = tmp_path / "t.jsonl"
    write_trace(path, trace)
    assert read_trace(path) == trace
    header = orjson.loads(path.read_bytes().splitlines()[0])
    assert header == {
        "kvgate_trace": 1,
        "block_tokens": 4,
        "tokenizer": "approx-4cpt",
        "salt_id": "abcd0123",
        "source": "capture",
    }


def test_mooncake_round_trip_is_byte_identical(tmp_path: Path) -> None:
    src = tmp_path / "m.jsonl"
    _write_lines(src, MOONCAKE)
    trace = read_trace(src)
    assert trace.block_tokens == 512
    assert trace.records[0].last_block_tokens == 1100 - 1024
    assert trace.records[1].arrival_s == pytest.approx(0.25)
    out = tmp_path / "out.jsonl"
    write_mooncake(out, trace)
    assert [orjson.loads(x) for x in out.read_bytes().splitlines()] == MOONCAKE


def test_mooncake_through_kvgate_format_and_back(tmp_path: Path) -> None:
    src = tmp_path / "m.jsonl"
    _write_lines(src, MOONCAKE)
    native = tmp_path / "n.jsonl"
    write_trace(native, read_trace(src))
    back = [orjson.loads(x) for x in mooncake_lines(read_trace(native))]
    assert back == MOONCAKE


def test_small_blocks_to_mooncake_keep_prefix_structure() -> None:
    # 64-token blocks: r0 and r1 share their first 9 blocks (576 tokens), so they share the
    # first 512-token block and differ in the second.
    shared = tuple(range(100, 109))
    r0 = TraceRecord(0.0, 64 * 12, 1, shared + (1, 2, 3), 64)
    r1 = TraceRecord(0.1, 64 * 10 + 10, 1, shared + (4, 5), 10)
    lines = [orjson.loads(x) for x in mooncake_lines(Trace(TraceHeader(block_tokens=64), (r0, r1)))]
    assert lines[0]["hash_ids"] == [0, 1]
    assert lines[1]["hash_ids"] == [0, 2]
    assert lines[1]["input_length"] == 650


def test_mooncake_rejects_wrong_id_count(tmp_path: Path) -> None:
    src = tmp_path / "bad.jsonl"
    _write_lines(
        src, [{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [0, 1]}]
    )
    with pytest.raises(TraceFormatError, match="ceil"):
        read_trace(src)


def test_kvgate_rejects_inconsistent_lengths(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    _write_lines(
        path,
        [
            {"kvgate_trace": 1, "block_tokens": 4},
            {
                "arrival_s": 0,
                "input_tokens": 9,
                "output_tokens": 1,
                "block_hashes": [1, 2],
                "last_block_tokens": 4,
            },
        ],
    )
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:2"):
        read_trace(path)


def test_not_json_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"kvgate_trace": 1}\n{oops\n')
    with pytest.raises(TraceFormatError, match=":2: not JSON"):
        read_trace(path)


def test_azure_csv(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
    )
    trace = read_trace(path)
    assert [(r.input_tokens, r.output_tokens) for r in trace.records] == [(374, 44), (396, 109)]
    assert trace.records[1].arrival_s == pytest.approx(4.314579, abs=1e-6)
    assert all(not r.block_hashes for r in trace.records)


def test_rechunk_512_to_16_keeps_shared_prefixes() -> None:
    rechunk = Rechunker(512, 16)
    a = rechunk((7, 8, 9), 1100)
    b = rechunk((7, 8, 10), 1030)
    assert len(a) == -(-1100 // 16) and len(b) == -(-1030 // 16)
    assert a[:64] == b[:64]  # two shared 512-token blocks = 64 engine blocks
    assert a[64] != b[64]
    assert len(set(a)) == len(a)
    assert Rechunker(512, 16)((7, 8, 9), 1100) == a  # deterministic across instances


def test_rechunk_unaligned_sizes() -> None:
    rechunk = Rechunker(48, 32)
    a = rechunk((1, 2, 3), 140)
    b = rechunk((1, 2, 4), 140)
    # New block k is shared iff the old block holding its last token is shared.
    assert len(a) == 5
    assert a[:3] == b[:3] and a[3:] != b[3:]


def test_window_rebases_arrivals() -> None:
    recs = tuple(TraceRecord(float(t), 1, 1) for t in (5, 7, 12))
    w = Trace(TraceHeader(), recs).window(1, 2)
    assert [r.arrival_s for r in w.records] == [0.0, 5.0]


@pytest.mark.skipif(not SHARED.is_dir(), reason="shared traces not present")
def test_shared_traces_parse() -> None:
    mooncake = read_trace(SHARED / "synthetic_trace.jsonl")
    assert len(mooncake.records) == 3993
    assert mooncake.records[0].input_tokens == 40160
    azure = read_trace(SHARED / "AzureLLMInferenceTrace_conv.csv")
    assert len(azure.records) == 19366
