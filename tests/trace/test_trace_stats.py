"""Trace statistics and hit-rate maths on hand-made traces."""

from __future__ import annotations

import math
from pathlib import Path

import orjson
import pytest

from gateway.trace.cli import main
from gateway.trace.format import Trace, TraceHeader, TraceRecord, write_trace
from gateway.trace.stats import (
    PrefixCache,
    cluster_hit_rate,
    compute_cost,
    compute_stats,
    hit_rate,
    parse_tokens,
    render_stats,
)

# Block size 4. A and D are the same prompt, B shares A's first two blocks, C is unrelated.
A = TraceRecord(0.0, 12, 3, (1, 2, 3), 4)
B = TraceRecord(1.0, 10, 5, (1, 2, 5), 2)
C = TraceRecord(2.0, 3, 1, (9,), 3)
D = TraceRecord(4.0, 12, 2, (1, 2, 3), 4)
TRACE = Trace(TraceHeader(block_tokens=4), (A, B, C, D))
TOTAL_IN = 12 + 10 + 3 + 12


def test_infinite_cache_hit_rate() -> None:
    # B hits blocks 1,2 (8 tokens); D hits all 12.
    assert hit_rate(TRACE) == pytest.approx(20 / TOTAL_IN)


def test_lru_evicts_leaves_before_shared_roots() -> None:
    # 3 blocks: after C, block 5 (a leaf) went first, then 3; the shared roots 1,2 stay,
    # so D still hits 8 tokens. A plain insertion-order LRU would have evicted root 1.
    assert hit_rate(TRACE, capacity_tokens=12) == pytest.approx((8 + 8) / TOTAL_IN)
    # One block: only the root survives each request, so B hits block 1 and nothing else.
    assert hit_rate(TRACE, capacity_tokens=4) == pytest.approx(4 / TOTAL_IN)
    assert hit_rate(TRACE, capacity_tokens=10_000) == pytest.approx(hit_rate(TRACE))


def test_prefix_scan_stops_at_first_miss() -> None:
    cache = PrefixCache()
    cache.access((1, 2, 3), (4, 4, 4))
    assert cache.access((7, 2, 3), (4, 4, 4)) == 0  # a later equal hash is not a prefix hit


def test_cluster_round_robin_scatters_and_lineage_keeps_prefixes_together() -> None:
    rr = cluster_hit_rate(TRACE, 2, "round_robin")
    # A->r0, B->r1, C->r0, D->r1: only D finds B's blocks 1,2 on r1.
    assert rr.hit_rate == pytest.approx(8 / TOTAL_IN)
    assert rr.request_share == (0.5, 0.5)
    ch = cluster_hit_rate(TRACE, 2, "lineage")
    # D repeats A's prompt: A's conversation, on A's replica, all 12 tokens cached. B is
    # a new conversation sharing 8 tokens with A and nothing is in flight: it follows its
    # cache to A's replica (live sessions only break ties there). C, unrelated, goes to
    # the replica without a live session.
    assert ch.hit_rate == pytest.approx(20 / TOTAL_IN)
    assert ch.request_share == (0.75, 0.25) or ch.request_share == (0.25, 0.75)


def test_shape_statistics() -> None:
    s = compute_stats(TRACE, lru_tokens=[12], replicas=2, policies=["round_robin"])
    assert s.requests == 4
    assert s.duration_s == 4.0 and s.rate_per_s == 1.0
    assert s.input_tokens.p50 == pytest.approx(11.0)
    assert s.output_tokens.p90 == pytest.approx(4.4)
    assert s.ratio_median == pytest.approx((3.0 + 4.0) / 2)  # ratios 4, 2, 3, 6
    assert s.long_share == 0.0
    assert (s.total_input, s.total_output) == (TOTAL_IN, 11)
    assert s.hit_rate_lru == {12: pytest.approx(16 / TOTAL_IN)}
    assert len(s.cluster) == 2  # infinite + 12 tokens per replica
    text = render_stats(s)
    assert "requests         4" in text and "round_robin" in text


def test_long_context_share() -> None:
    recs = (TraceRecord(0.0, 20_000, 10), TraceRecord(1.0, 100, 10), TraceRecord(2.0, 16_385, 1))
    s = compute_stats(Trace(TraceHeader(), recs))
    assert s.long_share == pytest.approx(2 / 3)
    assert s.hit_rate_infinite is None


def test_cost_per_million_tokens() -> None:
    # 2 cards at $3/h doing 10,000 total tok/s together: $6 per 36M tokens.
    c = compute_cost(
        total_tokens=1000,
        output_tokens=10,
        price_per_card_hour=3.0,
        throughput_tokens_s=10_000,
        cards=2,
    )
    assert c.per_million_total == pytest.approx(6 / 36)
    assert c.per_million_output == pytest.approx(6 / 36 * 100)
    with pytest.raises(ValueError):
        compute_cost(1, 1, 1.0, 0.0)


def test_parse_tokens() -> None:
    assert parse_tokens("1M") == 1_000_000
    assert parse_tokens("250k") == 250_000
    assert parse_tokens("inf") is None
    with pytest.raises(ValueError):
        parse_tokens("lots")


def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, TRACE)
    assert (
        main(
            [
                "trace",
                "stats",
                str(path),
                "--lru",
                "12",
                "--replicas",
                "2",
                "--policy",
                "round_robin",
                "--price-per-card-hour",
                "2",
                "--throughput",
                "1000",
                "--json",
            ]
        )
        == 0
    )
    out = orjson.loads(capsys.readouterr().out)
    assert out["hit_rate_infinite"] == pytest.approx(20 / TOTAL_IN)
    assert out["cluster"][0]["hit_rate"] == pytest.approx(8 / TOTAL_IN)
    assert math.isclose(out["cost"]["per_million_total"], 2 / 3.6)


def test_cli_unknown_policy_is_a_clean_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, TRACE)
    assert main(["trace", "stats", str(path), "--replicas", "2", "--policy", "nope"]) == 2
    assert "unknown routing policy" in capsys.readouterr().err


def test_kvgate_cli_dispatches_trace_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.cli import main as kvgate

    path = tmp_path / "t.jsonl"
    write_trace(path, TRACE)
    assert kvgate(["trace", "stats", str(path)]) == 0
    assert "requests         4" in capsys.readouterr().out
    mooncake = tmp_path / "m.jsonl"
    assert kvgate(["trace", "convert", str(path), "-o", str(mooncake), "--to", "mooncake"]) == 0
    lines = [orjson.loads(x) for x in mooncake.read_bytes().splitlines()]
    assert [x["input_length"] for x in lines] == [12, 10, 3, 12]
    assert lines[0]["hash_ids"] == lines[3]["hash_ids"] == [0]


def test_plots_write_pngs_or_explain_the_missing_extra(tmp_path: Path) -> None:
    import importlib.util

    from gateway.errors import ConfigError
    from gateway.trace.plots import write_plots

    if importlib.util.find_spec("matplotlib") is None:
        with pytest.raises(ConfigError, match=r"kvgate\[plots\]"):
            write_plots(TRACE, tmp_path)
        return
    written = write_plots(TRACE, tmp_path, sweep=(4, 8, 16))
    assert [p.name for p in written] == ["context_length_cdf.png", "hit_rate_vs_cache_size.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)
