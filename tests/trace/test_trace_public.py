"""The public traces read as published (the Mooncake FAST'25 synthetic JSONL, the Azure 2023
conversation CSV, read from the shared folder beside the checkout, never copied in), their
statistics checked against a plain-Python reading of the same lines, and `kvgate trace
stats|convert` with their error paths through the CLI."""

from __future__ import annotations

import csv
import io
import json
import statistics
from datetime import datetime
from pathlib import Path

import orjson
import pytest

from gateway.cli import main
from gateway.trace.format import (
    MOONCAKE_BLOCK_TOKENS,
    TraceFormatError,
    parse_azure,
    parse_kvgate,
    parse_mooncake,
    read_trace,
)
from gateway.trace.stats import compute_stats, hit_rate


def _shared_traces() -> Path | None:
    for folder in Path(__file__).resolve().parents:
        candidate = folder / "shared" / "traces"
        if candidate.is_dir():
            return candidate
    return None


SHARED = _shared_traces()
needs_shared = pytest.mark.skipif(SHARED is None, reason="shared traces not present")
ROWS = 300


def head(src: Path, dst: Path, lines: int) -> Path:
    with src.open("rb") as fh, dst.open("wb") as out:
        for _ in range(lines):
            out.write(fh.readline())
    return dst


@pytest.fixture(scope="module")
def mooncake_head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert SHARED is not None
    return head(
        SHARED / "synthetic_trace.jsonl", tmp_path_factory.mktemp("mc") / "mooncake.jsonl", ROWS
    )


@pytest.fixture(scope="module")
def azure_head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert SHARED is not None
    src = SHARED / "AzureLLMInferenceTrace_conv.csv"
    return head(src, tmp_path_factory.mktemp("az") / "azure.csv", ROWS + 1)  # + the header


def reference_hit_rate(rows: list[dict[str, int | list[int]]]) -> float:
    """Infinite prefix cache, by the Mooncake README's rule: equal leading ids are reusable
    KV, 512 tokens each, the last block holding what is left of input_length."""
    seen: set[int] = set()
    hits = total = 0
    for row in rows:
        ids, length = row["hash_ids"], row["input_length"]
        assert isinstance(ids, list) and isinstance(length, int)
        total += length
        for k, h in enumerate(ids):
            if h not in seen:
                break
            hits += min(MOONCAKE_BLOCK_TOKENS, length - k * MOONCAKE_BLOCK_TOKENS)
        seen.update(ids)
    return hits / total


@needs_shared
def test_mooncake_head_reads_as_published(mooncake_head: Path) -> None:
    rows = [json.loads(line) for line in mooncake_head.read_text().splitlines()]
    trace = read_trace(mooncake_head)
    assert trace.header.source == "mooncake" and trace.block_tokens == 512
    assert len(trace.records) == len(rows) == ROWS
    for row, rec in zip(rows, trace.records, strict=True):
        assert rec.arrival_s == pytest.approx(row["timestamp"] / 1000)  # ms -> s
        assert (rec.input_tokens, rec.output_tokens) == (row["input_length"], row["output_length"])
        assert list(rec.block_hashes) == row["hash_ids"]
        assert sum(rec.block_lengths(512)) == row["input_length"]
    stats = compute_stats(trace)
    inputs = [r["input_length"] for r in rows]
    outputs = [r["output_length"] for r in rows]
    assert (stats.total_input, stats.total_output) == (sum(inputs), sum(outputs))
    assert stats.ratio_median == statistics.median(
        i / o for i, o in zip(inputs, outputs, strict=True) if o
    )
    assert stats.long_share == sum(1 for i in inputs if i > 16384) / ROWS
    assert stats.duration_s == (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000
    # The shared-prefix fraction: what an infinite cache would serve.
    expected = reference_hit_rate(rows)
    assert 0.0 < expected < 1.0
    assert stats.hit_rate_infinite == pytest.approx(expected, abs=1e-12)
    # An LRU of one block can serve nothing but a request repeating the previous one's
    # first block; a cache larger than all the blocks serves the infinite figure.
    blocks = {h for r in rows for h in r["hash_ids"]}
    assert hit_rate(trace, (len(blocks) + 1) * 512) == pytest.approx(expected)
    assert hit_rate(trace, 512) < expected


@needs_shared
def test_azure_head_reads_arrivals_and_lengths(azure_head: Path) -> None:
    with azure_head.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    trace = read_trace(azure_head)
    assert trace.header.source == "azure" and len(trace.records) == ROWS
    stamps = sorted(datetime.fromisoformat(r["TIMESTAMP"]) for r in rows)
    arrivals = [rec.arrival_s for rec in trace.records]
    assert arrivals == [(t - stamps[0]).total_seconds() for t in stamps]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    stats = compute_stats(trace)
    assert not stats.has_prefixes and stats.hit_rate_infinite is None
    assert stats.total_input == sum(int(r["ContextTokens"]) for r in rows)
    assert stats.total_output == sum(int(r["GeneratedTokens"]) for r in rows)
    assert stats.rate_per_s == pytest.approx(ROWS / arrivals[-1])


@needs_shared
def test_cli_stats_of_the_mooncake_head(
    mooncake_head: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["trace", "stats", str(mooncake_head), "--lru", "64k,inf", "--json"])
    out, _ = capsys.readouterr()
    data = orjson.loads(out)
    assert code == 0 and data["requests"] == ROWS and data["block_tokens"] == 512
    rows = [json.loads(line) for line in mooncake_head.read_text().splitlines()]
    assert data["hit_rate_infinite"] == pytest.approx(reference_hit_rate(rows))
    assert list(data["hit_rate_lru"]) == ["64000"]  # k is 1,000; inf is always reported
    assert data["hit_rate_lru"]["64000"] <= data["hit_rate_infinite"]
    code = main(["trace", "stats", str(mooncake_head), "--lru", "1M"])
    text, _ = capsys.readouterr()
    assert code == 0 and "(512 tokens/block)" in text and "LRU 1M tokens" in text


@needs_shared
def test_convert_mooncake_to_kvgate_and_back_keeps_every_record(
    mooncake_head: Path, tmp_path: Path
) -> None:
    ours, back = tmp_path / "t.jsonl", tmp_path / "m.jsonl"
    assert main(["trace", "convert", str(mooncake_head), "-o", str(ours), "--to", "kvgate"]) == 0
    assert main(["trace", "convert", str(ours), "-o", str(back), "--to", "mooncake"]) == 0
    first = read_trace(mooncake_head)
    assert read_trace(ours).header.source == "mooncake"
    again = read_trace(back)
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in again.records] == [
        (r.arrival_s, r.input_tokens, r.output_tokens) for r in first.records
    ]
    # Ids are remapped in order of first appearance: the same prefix structure.
    assert hit_rate(again) == pytest.approx(hit_rate(first))


def test_azure_rows_out_of_order_are_sorted_and_rebased() -> None:
    text = (
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:50.5,396,109\n"
        "2023-11-16 18:15:46.0,374,44\n"
        "2023-11-16 18:16:46.0,20000,1\n"
    )
    trace = parse_azure(io.StringIO(text))
    assert [r.arrival_s for r in trace.records] == [0.0, 4.5, 60.0]
    assert [r.input_tokens for r in trace.records] == [374, 396, 20000]
    stats = compute_stats(trace)
    assert stats.ratio_median == statistics.median([374 / 44, 396 / 109, 20000])
    assert stats.long_share == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("a.csv", "when,prompt\n1,2\n", "expected CSV columns"),
        ("b.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n", "b.csv:2: bad row"),
        ("c.csv", "", "expected CSV columns"),
        ("d.jsonl", '{"timestamp": 0, "input_length": 10}\n', "bad Mooncake record"),
        (
            "e.jsonl",
            '{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2]}\n',
            "2 hash_ids for input_length 1100",
        ),
        ("f.jsonl", '{"timestamp": 0}\n[1]\n', "f.jsonl:1: bad Mooncake record"),
        ("g.jsonl", '{"kvgate_trace": 1}\n{"x": \n', "g.jsonl:2: not JSON"),
        ("h.jsonl", '{"kvgate_trace": 99}\n', "unsupported kvgate_trace version 99"),
        ("i.jsonl", '{"kvgate_trace": 1, "block_tokens": 0}\n', "block_tokens must be a positive"),
        (
            "j.jsonl",
            '{"kvgate_trace": 1}\n{"arrival_s": 0, "input_tokens": -1, "output_tokens": 1}\n',
            "j.jsonl:2: negative token count",
        ),
        (
            "k.jsonl",
            '{"kvgate_trace": 1, "block_tokens": 16}\n'
            '{"arrival_s": 0, "input_tokens": 40, "output_tokens": 1,'
            ' "block_hashes": [1, 2, 3], "last_block_tokens": 20}\n',
            "last_block_tokens 20 outside 1..16",
        ),
        (
            "l.jsonl",
            '{"kvgate_trace": 1, "block_tokens": 16}\n'
            '{"arrival_s": 0, "input_tokens": 40, "output_tokens": 1,'
            ' "block_hashes": [1, 2, 3], "last_block_tokens": 4}\n',
            "make 36 tokens, not input_tokens 40",
        ),
        (
            "m.jsonl",
            '{"kvgate_trace": 1}\n{"arrival_s": "soon", "input_tokens": 1, "output_tokens": 1}\n',
            "m.jsonl:2: bad record",
        ),
        ("n.jsonl", '{"kvgate_trace": 1}\n"a string"\n', "n.jsonl:2: expected a JSON object"),
    ],
)
def test_bad_trace_files_name_the_line_and_the_fault(
    tmp_path: Path, name: str, content: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(TraceFormatError, match=message):
        read_trace(path)
    # Through the CLI: one line on stderr, exit 2, for every command that reads a trace.
    for argv in (
        ["trace", "stats", str(path)],
        ["trace", "convert", str(path), "-o", str(tmp_path / "out"), "--to", "kvgate"],
        ["simulate", str(path)],
    ):
        assert main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert out == "" and message.split(":")[-1].strip() in err and "Traceback" not in err


def test_a_missing_or_binary_file_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(TraceFormatError, match="cannot read trace"):
        read_trace(tmp_path / "nope.jsonl")
    binary = tmp_path / "trace.bin"
    binary.write_bytes(bytes(range(128, 256)) * 4)
    with pytest.raises(TraceFormatError, match="neither"):
        read_trace(binary)
    for argv in (
        ["trace", "stats", str(binary)],
        ["trace", "convert", str(binary), "-o", str(tmp_path / "o"), "--to", "mooncake"],
    ):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and "neither" in err


def test_blank_lines_are_skipped_and_arrivals_sorted() -> None:
    lines = [
        b'{"kvgate_trace": 1, "block_tokens": 4, "source": "gateway"}\n',
        b"\n",
        b'{"arrival_s": 2.0, "input_tokens": 6, "output_tokens": 1, "block_hashes": [7, 8],'
        b' "last_block_tokens": 2, "session_id": 5}\n',
        b"   \n",
        b'{"arrival_s": 1.0, "input_tokens": 3, "output_tokens": 2}\n',
    ]
    trace = parse_kvgate(lines, "t")
    assert [r.arrival_s for r in trace.records] == [1.0, 2.0]
    assert trace.records[1].session_id == "5" and trace.header.source == "gateway"
    with pytest.raises(TraceFormatError, match="empty trace"):
        parse_kvgate([b"\n"], "t")
    # Mooncake timestamps that do not start at 0 are re-based to the first request.
    later = parse_mooncake(
        [
            b'{"timestamp": 5000, "input_length": 3, "output_length": 1, "hash_ids": [0]}\n',
            b'{"timestamp": 5250, "input_length": 3, "output_length": 1}\n',
        ]
    )
    assert [r.arrival_s for r in later.records] == [0.0, 0.25]
    assert later.records[1].block_hashes == ()


def test_stats_of_a_header_only_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text('{"kvgate_trace": 1}\n')
    assert main(["trace", "stats", str(path), "--json"]) == 0
    data = orjson.loads(capsys.readouterr().out)
    assert data["requests"] == 0 and data["total_input_tokens"] == 0
    assert data["rate_per_s"] is None  # NaN: no duration to divide by
    assert main(["trace", "stats", str(path)]) == 0
    assert "requests         0" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lru", "lots"], "not a token count: 'lots'"),
        (["--lru", "-5"], "cache size must be positive"),
        (["--price-per-card-hour", "2", "--throughput", "0"], "throughput and cards > 0"),
    ],
)
def test_stats_options_are_checked(
    tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"kvgate_trace": 1, "block_tokens": 4}\n'
        '{"arrival_s": 0, "input_tokens": 4, "output_tokens": 1, "block_hashes": [1],'
        ' "last_block_tokens": 4}\n'
    )
    assert main(["trace", "stats", str(path), *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err


def test_cost_per_million_tokens_by_hand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"kvgate_trace": 1}\n'
        '{"arrival_s": 0, "input_tokens": 900, "output_tokens": 100}\n'
        '{"arrival_s": 1, "input_tokens": 2700, "output_tokens": 300}\n'
    )
    argv = ["--price-per-card-hour", "3.6", "--throughput", "1000", "--cards", "2"]
    assert main(["trace", "stats", str(path), *argv, "--json"]) == 0
    cost = orjson.loads(capsys.readouterr().out)["cost"]
    # 2 cards x $3.6/h = $7.2 per 3.6M tokens: $2 per M; output is 10% of the tokens.
    assert cost["per_million_total"] == pytest.approx(2.0)
    assert cost["per_million_output"] == pytest.approx(20.0)
    assert main(["trace", "stats", str(path), *argv]) == 0
    text = capsys.readouterr().out
    assert "$2.0000 per M total tokens, $20.00 per M output tokens" in text
    assert "prefix hit rate  n/a" in text and "median per-request ratio r = 9.0" in text
