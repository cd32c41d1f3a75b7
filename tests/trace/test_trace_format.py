"""Round trips of the kvgate trace format and the Mooncake/Azure converters."""

from __future__ import annotations

import csv
import os
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

# ../shared/traces beside the checkout (read there, never copied in); a worktree elsewhere
# names it with KVGATE_SHARED_TRACES.
SHARED = Path(
    os.environ.get(
        "KVGATE_SHARED_TRACES", Path(__file__).resolve().parents[2].parent / "shared" / "traces"
    )
)

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


def test_a_missing_trace_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match=r"cannot read trace .*nope\.jsonl: No such file"):
        read_trace(tmp_path / "nope.jsonl")


def test_a_binary_file_is_neither_format(tmp_path: Path) -> None:
    p = tmp_path / "blob.bin"
    p.write_bytes(b"\xff\xfe\x00garbage\x80")
    with pytest.raises(TraceFormatError, match=r"neither JSON lines .* nor an Azure CSV"):
        read_trace(p)


def test_blank_lines_before_the_first_record_are_skipped(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_bytes(b"\n  \n" + b"".join(orjson.dumps(o) + b"\n" for o in MOONCAKE))
    assert len(read_trace(p).records) == len(MOONCAKE)


def test_an_empty_file_is_an_error_naming_the_columns(tmp_path: Path) -> None:
    p = tmp_path / "empty"
    p.write_bytes(b"")
    with pytest.raises(TraceFormatError, match="expected CSV columns"):
        read_trace(p)


def test_azure_names_the_missing_columns_and_the_bad_row(tmp_path: Path) -> None:
    p = tmp_path / "a.csv"
    p.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,10\n")
    with pytest.raises(TraceFormatError, match="GeneratedTokens"):
        read_trace(p)
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46,10,1\n"
        "2023-11-16 18:15:47,ten,1\n"
    )
    with pytest.raises(TraceFormatError, match=r"a\.csv:3: bad row"):
        read_trace(p)
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,10,1\n")
    with pytest.raises(TraceFormatError, match=r"a\.csv:2: bad row"):
        read_trace(p)


def test_azure_rows_out_of_order_are_sorted_and_rebased(tmp_path: Path) -> None:
    p = tmp_path / "a.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:48.5,30,3\n"
        "2023-11-16 18:15:46.0,10,1\n"
        "2023-11-16 18:15:47.0,20,2\n"
    )
    t = read_trace(p)
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in t.records] == [
        (0.0, 10, 1),
        (1.0, 20, 2),
        (2.5, 30, 3),
    ]
    assert all(r.block_hashes == () for r in t.records)  # Azure has no prefix information
    assert t.header.source == "azure"


@pytest.mark.parametrize(
    ("line", "what"),
    [
        (b'{"timestamp": 0, "output_length": 1, "hash_ids": []}', "input_length"),
        (b'{"timestamp": "soon", "input_length": 5, "output_length": 1}', "soon"),
        (b'{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "'a'"),
        (b"[1, 2, 3]", "expected a JSON object"),
        (
            b'{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0, 1]}',
            "2 hash_ids",
        ),
    ],
)
def test_a_bad_mooncake_line_names_its_line_and_what_is_wrong(
    tmp_path: Path, line: bytes, what: str
) -> None:
    p = tmp_path / "m.jsonl"
    p.write_bytes(orjson.dumps(MOONCAKE[0]) + b"\n" + line + b"\n")
    with pytest.raises(TraceFormatError, match=r"m\.jsonl:2") as err:
        read_trace(p)
    assert what in str(err.value)


def test_mooncake_arrivals_are_rebased_to_the_first_request(tmp_path: Path) -> None:
    p = tmp_path / "m.jsonl"
    _write_lines(p, [{**o, "timestamp": o["timestamp"] + 5000} for o in MOONCAKE])  # type: ignore[operator]
    assert [r.arrival_s for r in read_trace(p).records] == [0.0, 0.25, 1.0]


def test_a_window_past_the_end_is_empty_and_a_window_keeps_order() -> None:
    t = Trace(TraceHeader(block_tokens=16), tuple(TraceRecord(float(i), 1, 1) for i in range(5)))
    assert t.window(9).records == ()
    w = t.window(2, 2)
    assert [r.arrival_s for r in w.records] == [0.0, 1.0]
    assert t.window(3).records[-1].arrival_s == 1.0


def test_rechunker_refuses_block_sizes_that_are_not_positive() -> None:
    for a, b in ((0, 16), (16, 0), (-1, 16)):
        with pytest.raises(ValueError, match="positive"):
            Rechunker(a, b)


def test_rechunk_to_larger_blocks_keeps_equal_prefixes_equal() -> None:
    r = Rechunker(16, 64)
    a = tuple(range(1, 21))  # 20 blocks of 16: 320 tokens, 5 blocks of 64
    b = a[:12] + (99, 98, 97)  # diverges inside the fourth 64-token block
    ha, hb = r(a, 320), r(b, 240)
    assert len(ha) == 5 and len(hb) == 4
    assert ha[:3] == hb[:3] and ha[3] != hb[3]


@pytest.mark.skipif(not SHARED.is_dir(), reason="shared traces not present")
def test_the_shared_azure_csv_is_read_row_for_row() -> None:
    path = SHARED / "AzureLLMInferenceTrace_conv.csv"
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    t = read_trace(path)
    assert len(t.records) == len(rows)
    arrivals = [r.arrival_s for r in t.records]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert sum(r.input_tokens for r in t.records) == sum(int(r["ContextTokens"]) for r in rows)
    assert sum(r.output_tokens for r in t.records) == sum(int(r["GeneratedTokens"]) for r in rows)


@pytest.mark.skipif(not SHARED.is_dir(), reason="shared traces not present")
def test_the_shared_mooncake_trace_keeps_its_prefix_structure_through_kvgate_format(
    tmp_path: Path,
) -> None:
    src = SHARED / "synthetic_trace.jsonl"
    t = read_trace(src)
    assert all(len(r.block_hashes) == -(-r.input_tokens // 512) for r in t.records)
    write_trace(tmp_path / "t.jsonl", t)
    again = read_trace(tmp_path / "t.jsonl")
    assert again.records == t.records
    write_mooncake(tmp_path / "m.jsonl", again)
    back = read_trace(tmp_path / "m.jsonl")
    # Ids are renumbered by first appearance: equal prefixes stay equal, distinct stay distinct.
    pairs = {}
    for r0, r1 in zip(t.records, back.records, strict=True):
        assert (r0.input_tokens, r0.output_tokens) == (r1.input_tokens, r1.output_tokens)
        assert abs(r0.arrival_s - r1.arrival_s) < 1e-3
        for h0, h1 in zip(r0.block_hashes, r1.block_hashes, strict=True):
            assert pairs.setdefault(h0, h1) == h1
    assert len(set(pairs.values())) == len(pairs)
