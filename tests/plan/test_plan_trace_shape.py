"""`kvgate plan --trace` on the public Mooncake trace (the first requests of the shared
copy, read where it lies), with the trace's shape checked against a plain reading of the
same lines; and the shape's arithmetic on hand-made traces."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import orjson
import pytest

from gateway.cli import main
from gateway.plan.fromtrace import TraceShape
from gateway.trace.format import Trace, TraceHeader, TraceRecord


def _shared_traces() -> Path | None:
    for folder in Path(__file__).resolve().parents:
        candidate = folder / "shared" / "traces"
        if candidate.is_dir():
            return candidate
    return None


SHARED = _shared_traces()
ROWS = 30


@pytest.fixture(scope="module")
def mooncake_head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if SHARED is None:
        pytest.skip("shared traces not present")
    dst = tmp_path_factory.mktemp("mc") / "head.jsonl"
    with (SHARED / "synthetic_trace.jsonl").open("rb") as src, dst.open("wb") as out:
        for _ in range(ROWS):
            out.write(src.readline())
    return dst


def test_plan_on_the_mooncake_head(mooncake_head: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [json.loads(line) for line in mooncake_head.read_text().splitlines()]
    argv = ["plan", "llama-3.1-8b", "--card", "h200", "--max-model-len", "65536"]
    argv += ["--trace", str(mooncake_head), "--ttft", "30", "--percentile", "mean"]
    assert main([*argv, "--max-replicas", "4", "--json"]) == 0
    data = orjson.loads(capsys.readouterr().out)
    shape = data["trace"]["shape"]
    inputs = [r["input_length"] for r in rows]
    outputs = [r["output_length"] for r in rows]
    assert shape == {
        "requests": ROWS,
        "duration_s": (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000,
        "input_p50": statistics.median(inputs),
        "output_p50": statistics.median(outputs),
        "input_output_ratio": sum(inputs) / sum(outputs),
    }
    (pool,) = data["trace"]["pools"]
    assert pool["pool"] == "h200-tp1" and pool["percentile"] == "mean"
    assert pool["kv_tokens_per_replica"] == data["plan"]["kv_tokens"]
    needed = pool["needed"]
    assert needed is not None and needed["ttft_mean_s"] <= 30 and needed["errors"] == 0
    # No price given: no cost, said as such in the text.
    assert needed["cost_per_million_total_tokens"] is None
    assert main([*argv, "--max-replicas", "4", "--limit", "10"]) == 0
    out, err = capsys.readouterr()
    assert "10 requests over" in out and "TTFT is mean; target 30 s" in out
    assert "h200-tp1: 1 replica(s): TTFT mean" in err  # progress on stderr, text mode only


def test_shape_by_hand() -> None:
    recs = (
        TraceRecord(1.0, 100, 10),
        TraceRecord(2.0, 300, 30),
        TraceRecord(4.5, 900, 20),
        TraceRecord(5.0, 500, 0),
    )
    shape = TraceShape.of(Trace(TraceHeader(), recs))
    assert (shape.requests, shape.duration_s) == (4, 4.0)
    assert (shape.input_p50, shape.output_p50) == (400, 15)
    assert (shape.total_input, shape.total_output) == (1800, 60)
    assert shape.ratio == 30.0 and shape.mean_context == (1800 + 60) // 4


def test_shape_of_degenerate_traces() -> None:
    one = TraceShape.of(Trace(TraceHeader(), (TraceRecord(3.0, 50, 0),)))
    assert one.duration_s == 0.0 and math.isinf(one.ratio) and one.mean_context == 50
    empty = TraceShape.of(Trace(TraceHeader(), ()))
    assert (empty.requests, empty.input_p50, empty.mean_context) == (0, 0, 1)
