"""`kvgate simulate` through the CLI on a small hand-made trace: a finite KV (--kv-blocks)
that must evict, the window options, determinism, its refusals; and `trace stats` on what a
live capture adds (the gateway's predicted, best and reported cache hits)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from gateway.cli import main
from gateway.trace.format import Trace, TraceHeader, TraceRecord, read_trace, write_trace
from gateway.trace.simulate import SimulationOptions, simulate
from gateway.trace.stats import cache_forecast, compute_stats, render_stats

BT = 16


def conversations(convs: int = 3, turns: int = 3) -> Trace:
    """Each turn of a conversation extends the last by 8 blocks of 16 tokens."""
    recs, t = [], 0.0
    for turn in range(turns):
        for c in range(convs):
            n = 8 * (turn + 1)
            hashes = tuple(c * 1000 + k for k in range(n))
            recs.append(TraceRecord(t, n * BT, 4, hashes, BT, f"c{c}"))
            t += 0.2
    return Trace(TraceHeader(block_tokens=BT), tuple(recs))


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sim") / "t.jsonl"
    write_trace(path, conversations())
    return path


def simulate_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(["simulate", *argv, "--json"]) == 0
    data: dict[str, object] = orjson.loads(capsys.readouterr().out)
    return data


def test_one_engine_with_room_hits_every_inherited_block(
    trace_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    roomy = simulate_json(capsys, str(trace_path), "--replicas", "1", "--profile", "instant")
    assert roomy["requests"] == 9 and roomy["errors"] == 0
    # Turns 2 and 3 of each conversation find the earlier turn's 128 and 256 tokens.
    inputs = sum(8 * (t + 1) * BT for t in range(3)) * 3
    assert roomy["prompt_tokens"] == inputs == 2304
    assert roomy["hit_rate"] == pytest.approx(3 * (128 + 256) / inputs)
    # The same trace and options give the same figures (only the wall clock differs).
    again = simulate_json(capsys, str(trace_path), "--replicas", "1", "--profile", "instant")
    timing = {"wall_s", "speed_factor"}
    assert {k: v for k, v in again.items() if k not in timing} == {
        k: v for k, v in roomy.items() if k not in timing
    }


def test_a_finite_kv_evicts_what_an_infinite_one_keeps(
    trace_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [str(trace_path), "--replicas", "1", "--profile", "instant"]
    roomy = simulate_json(capsys, *args)
    # 26 blocks (416 tokens) hold one last turn (384 + 4): the conversations evict each other.
    tight = simulate_json(capsys, *args, "--kv-blocks", "26")
    assert float(tight["hit_rate"]) < float(roomy["hit_rate"])  # type: ignore[arg-type]
    assert tight["errors"] == 0


def test_the_window_and_the_routing_options(
    trace_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    part = simulate_json(capsys, str(trace_path), "--start", "3", "--limit", "4", "--replicas", "2")
    assert part["requests"] == 4
    anonymous = simulate_json(
        capsys, str(trace_path), "--replicas", "2", "--no-session-ids", "--engine-priority"
    )
    assert anonymous["requests"] == 9 and anonymous["errors"] == 0
    assert main(["simulate", str(trace_path), "--replicas", "2"]) == 0
    text = capsys.readouterr().out
    assert "9" in text and "TTFT" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-blocks", "0"], "--kv-blocks must be positive"),
        (["--policy-config", "[1, 2]"], "--policy-config must be a JSON object"),
        (["--policy-config", "{oops"], "unexpected character"),
        (["--replicas", "0"], "replicas must be positive"),
        (["--speedup", "0"], "speedup must be positive"),
        (["--policy", "no-such-policy"], "no-such-policy"),
    ],
)
def test_simulate_refuses(
    trace_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", str(trace_path), *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err


def test_simulate_is_deterministic() -> None:
    trace = conversations(4, 2)
    opts = SimulationOptions(replicas=2, profile="tiny", seed=3)
    a, b = simulate(trace, opts), simulate(trace, opts)
    assert [(r.replica, r.cached_tokens, r.ttft_s) for r in a.report.results] == [
        (r.replica, r.cached_tokens, r.ttft_s) for r in b.report.results
    ]


def forecasted() -> Trace:
    recs = (
        TraceRecord(0.0, 100, 1, predicted_cached=0, best_cached=0, achieved_cached=0),
        TraceRecord(1.0, 300, 1, predicted_cached=200, best_cached=250, achieved_cached=160),
        TraceRecord(2.0, 600, 1, predicted_cached=500, best_cached=500, achieved_cached=520),
        TraceRecord(3.0, 900, 1, predicted_cached=800),  # not all three: left out
    )
    return Trace(TraceHeader(), recs)


def test_the_gateways_cache_forecast_against_what_engines_reported(tmp_path: Path) -> None:
    trace = forecasted()
    path = tmp_path / "live.jsonl"
    write_trace(path, trace)
    again = read_trace(path)
    assert again.records == trace.records  # the three figures survive a write
    f = cache_forecast(again)
    assert f is not None
    # Three requests carry all three: 1,000 input tokens, 700 predicted, 750 best, 680
    # reported; |0-0| + |160-200| + |520-500| = 60 tokens over 3 requests.
    assert (f.requests, f.input_tokens, f.predicted, f.best, f.achieved) == (3, 1000, 700, 750, 680)
    assert f.mean_abs_error == pytest.approx(20.0)
    text = render_stats(compute_stats(again))
    assert (
        "cache forecast   3 requests as routed: predicted 70.0%, best replica 75.0%,"
        " engine reported 68.0% of their input; mean |reported - predicted| 20 tokens"
    ) in text
    assert cache_forecast(Trace(TraceHeader(), trace.records[-1:])) is None


def test_stats_cli_json_carries_the_forecast(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "live.jsonl"
    write_trace(path, forecasted())
    assert main(["trace", "stats", str(path), "--json"]) == 0
    data = orjson.loads(capsys.readouterr().out)
    assert data["cache_forecast"] == {
        "requests": 3,
        "input_tokens": 1000,
        "predicted_tokens": 700,
        "best_tokens": 750,
        "achieved_tokens": 680,
        "mean_abs_error_tokens": 20.0,
    }
