"""`kvgate trace generate|replay|capture|stats` through the CLI: every generated shape seeded
and checked for what the docs promise (a later turn keeps every full block of the one it
extends), replay against a real gateway over simulated engines on loopback, capture with a
real `tokenizer.json`, and the tier columns a gateway's capture writes."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import defaultdict
from pathlib import Path

import orjson
import pytest

from gateway.cli import main
from gateway.trace.format import Trace, TraceHeader, TraceRecord, read_trace, write_trace
from gateway.trace.stats import compute_stats, hit_rate
from gateway.trace.tokenize import HFTokenizer, load_tokenizer

SHAPES = ("agent", "forks", "samples", "rag")
SMALL = ["--sessions", "6", "--context-scale", "0.02", "--block-tokens", "16", "--kinds", "2"]


def generate(path: Path, shape: str, *extra: str) -> Trace:
    assert main(["trace", "generate", "-o", str(path), "--shape", shape, *SMALL, *extra]) == 0
    return read_trace(path)


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("generated")
    out = {}
    for shape in SHAPES:
        out[shape] = folder / f"{shape}.jsonl"
        generate(out[shape], shape, "--seed", "7")
    return out


def full_blocks(rec: TraceRecord, block: int) -> tuple[int, ...]:
    whole = len(rec.block_hashes) - (rec.last_block_tokens < block)
    return rec.block_hashes[:whole]


@pytest.mark.parametrize("shape", SHAPES)
def test_same_seed_same_bytes_other_seed_other_trace(
    shape: str, generated: dict[str, Path], tmp_path: Path
) -> None:
    again = tmp_path / "again.jsonl"
    generate(again, shape, "--seed", "7")
    assert again.read_bytes() == generated[shape].read_bytes()
    other = generate(tmp_path / "other.jsonl", shape, "--seed", "8")
    assert other.records != read_trace(generated[shape]).records


@pytest.mark.parametrize("shape", SHAPES)
def test_each_turn_keeps_every_full_block_of_the_turn_before(
    shape: str, generated: dict[str, Path]
) -> None:
    trace = read_trace(generated[shape])
    assert trace.block_tokens == 16 and trace.records
    by_session: dict[str, list[TraceRecord]] = defaultdict(list)
    for rec in trace.records:
        assert rec.session_id is not None
        by_session[rec.session_id].append(rec)
    extended = 0
    for recs in by_session.values():
        for before, after in itertools.pairwise(recs):
            kept = full_blocks(before, 16)
            assert after.block_hashes[: len(kept)] == kept
            assert after.input_tokens >= before.input_tokens
            extended += 1
    assert extended > 0
    # So an infinite cache serves at least each turn's inherited full blocks.
    inherited = sum(16 * len(full_blocks(b, 16)) for recs in by_session.values() for b in recs[:-1])
    total = sum(r.input_tokens for r in trace.records)
    assert hit_rate(trace) >= inherited / total


def test_shapes_have_their_documented_structure(generated: dict[str, Path]) -> None:
    forks = read_trace(generated["forks"]).records
    children = [r for r in forks if r.session_id and "/" in r.session_id]
    assert children, "no subagent in the forks trace"
    for child in children:
        parent = child.session_id.rsplit("/", 1)[0]  # type: ignore[union-attr]
        # A subagent's first prompt is its parent's whole history plus its own task.
        earlier = [r for r in forks if r.session_id == parent and r.arrival_s <= child.arrival_s]
        assert earlier and child.block_hashes[: len(full_blocks(earlier[-1], 16))] == (
            full_blocks(earlier[-1], 16)
        )
    samples = read_trace(generated["samples"]).records
    turns: dict[tuple[str | None, float], list[TraceRecord]] = defaultdict(list)
    for r in samples:
        turns[(r.session_id, r.arrival_s)].append(r)
    sizes = {len(v) for v in turns.values()}
    assert max(sizes) >= 2  # each turn of a sampled conversation is sent n times at once
    for same in turns.values():
        assert len({r.block_hashes for r in same}) == 1
    # Documents are shared across RAG sessions: some block opens more than one session.
    rag = read_trace(generated["rag"]).records
    firsts: dict[str, TraceRecord] = {}
    for r in rag:
        firsts.setdefault(r.session_id or "", r)
    owners: dict[int, set[str]] = defaultdict(set)
    for sid, r in firsts.items():
        for h in r.block_hashes:
            owners[h].add(sid)
    assert max(len(v) for v in owners.values()) > 1


def test_the_agent_trace_statistics_by_the_docs(tmp_path: Path) -> None:
    """The docstring's aims (context P50 ~108K, input:output median ~256, >97% over 16K,
    ~94% of input reusable) at full scale, on a few sessions."""
    trace = generate(
        tmp_path / "full.jsonl",
        "agent",
        "--seed",
        "3",
        "--sessions",
        "4",
        "--context-scale",
        "1",
        "--block-tokens",
        "512",
    )
    stats = compute_stats(trace)
    assert 50_000 < stats.input_tokens.p50 < 200_000
    assert 100 < stats.ratio_median < 600
    assert stats.long_share > 0.9
    assert stats.hit_rate_infinite is not None and stats.hit_rate_infinite > 0.85


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sessions", "-1"], "sessions must be >= 0"),
        (["--context-scale", "0"], "context_scale and duration_s must be positive"),
        (["--rate", "0"], "rate_per_s must be positive"),
        (["--think", "-1"], "think_s must be >= 0"),
        (["--shape", "forks", "--kinds", "0"], "kinds and block_tokens > 0"),
        (["--shape", "rag", "--context-scale", "-1"], "context_scale and duration_s"),
        (["--shape", "samples", "--block-tokens", "0"], "kinds and block_tokens > 0"),
    ],
)
def test_generate_refuses_bad_options(
    tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "t.jsonl"
    assert main(["trace", "generate", "-o", str(out), *argv]) == 2
    assert message in capsys.readouterr().err and not out.exists()


def test_generate_rate_sets_the_window_for_shapes_too(tmp_path: Path) -> None:
    # 6 sessions at 60 per second start within about 0.1 s; over --duration 300 they spread.
    fast = generate(tmp_path / "fast.jsonl", "rag", "--rate", "60")
    slow = generate(tmp_path / "slow.jsonl", "rag", "--duration", "300")
    first = {
        name: sorted({min(r.arrival_s for r in t.records if r.session_id == s) for s in ids})
        for name, t in (("fast", fast), ("slow", slow))
        for ids in [{r.session_id for r in t.records if r.session_id}]
    }
    assert first["fast"][-1] < 5.0 < first["slow"][-1]


def test_generate_to_an_unwritable_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "missing-dir" / "t.jsonl"
    assert main(["trace", "generate", "-o", str(target), *SMALL]) == 2
    assert "No such file or directory" in capsys.readouterr().err


async def test_replay_cli_through_a_gateway_on_simulated_engines(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    from gateway.testing.servers import gateway, sim_engines

    trace = read_trace(generated["agent"]).window(0, 12)
    path = tmp_path / "window.jsonl"
    write_trace(path, trace)
    async with sim_engines(2, "h200-sparse", time_scale=50.0) as engines, gateway(engines) as gw:
        argv = ["trace", "replay", str(path), "--url", gw.url, "--json", "--quiet"]
        code, out = await asyncio.to_thread(run_captured, [*argv, "--speedup", "1000"])
        closed, _ = await asyncio.to_thread(
            run_captured, [*argv, "--concurrency", "3", "--endpoint", "completions", "--limit", "4"]
        )
    assert code == 0
    report = json.loads(out)
    assert (report["requests"], report["ok"], report["errors"]) == (12, 12, 0)
    # The chat template adds a few tokens to each prompt; outputs are the trace's.
    assert report["output_tokens"] == sum(r.output_tokens for r in trace.records)
    assert report["prompt_tokens"] >= sum(r.input_tokens for r in trace.records)
    # The gateway keeps each session on one engine, so later turns hit their prefix.
    assert report["hit_rate"] > 0.3
    assert closed == 0
    # Nothing listens once the gateway has stopped: every request fails, exit status 1.
    code, out = await asyncio.to_thread(
        run_captured, [*argv, "--timeout", "2", "--concurrency", "12"]
    )
    assert code == 1 and json.loads(out)["errors"] == 12


def run_captured(argv: list[str]) -> tuple[int, str]:
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main(argv)
    return code, buffer.getvalue()


def test_replay_cli_input_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "replay", str(tmp_path / "none.jsonl"), "--url", "http://x"]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"kvgate_trace": 1}\n{"arrival_s": 0, "input_tokens": 8, "output_tokens": 1}\n'
    )
    with pytest.raises(SystemExit) as info:
        main(["trace", "replay", str(path), "--url", "http://x", "--layout", "spiral"])
    assert info.value.code == 2 and "invalid choice: 'spiral'" in capsys.readouterr().err


def word_tokenizer(path: Path) -> Path:
    """A real `tokenizer.json`: word level, one id per whitespace-separated word."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(64)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


def test_capture_with_a_real_tokenizer_counts_and_hashes_by_its_ids(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("tokenizers")
    tok_path = word_tokenizer(tmp_path / "tokenizer.json")
    tok = load_tokenizer(tok_path)
    assert isinstance(tok, HFTokenizer) and tok.name == f"hf:{tmp_path.name}"
    shared = " ".join(f"w{i}" for i in range(40))
    assert tok.count(shared) == 40
    count, blocks = tok.blocks(shared, 16)
    assert count == 40 and [len(b) for b in blocks] == [64, 64, 32]  # 4 bytes per id
    requests = tmp_path / "requests.jsonl"
    requests.write_text(
        "\n".join(
            json.dumps({"model": "m", "prompt": text, "max_tokens": 2})
            for text in (shared, shared + " w50 w51", "w1 w2 w3")
        )
        + "\n"
    )
    salt = tmp_path / "salt"
    out = tmp_path / "trace.jsonl"
    argv = ["trace", "capture", str(requests), "-o", str(out), "--salt-file", str(salt)]
    assert main([*argv, "--tokenizer", str(tok_path), "--block-tokens", "16"]) == 0
    assert "captured 3 requests" in capsys.readouterr().err
    trace = read_trace(out)
    assert trace.header.tokenizer == f"hf:{tmp_path.name}"
    a, b, c = trace.records
    assert (a.input_tokens, b.input_tokens, c.input_tokens) == (40, 42, 3)
    assert a.block_hashes[:2] == b.block_hashes[:2] and a.block_hashes[2] != b.block_hashes[2]
    assert c.block_hashes[0] not in a.block_hashes


def test_capture_with_a_missing_tokenizer_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    requests = tmp_path / "r.jsonl"
    requests.write_text('{"model": "m", "prompt": "hi"}\n')
    argv = ["trace", "capture", str(requests), "-o", str(tmp_path / "o.jsonl")]
    assert main([*argv, "--tokenizer", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    assert "tokenizer file" in err and "does not exist" in err


def test_tier_columns_survive_a_write_and_show_in_stats(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recs = (
        TraceRecord(0.0, 100, 10, tier="small", tier_reason="rule:0", tier_score=0.2),
        TraceRecord(1.0, 300, 30, tier="small", tier_reason="features", tier_score=0.4),
        TraceRecord(2.0, 500, 50, tier="large", tier_reason="escalated:length"),
        TraceRecord(3.0, 700, 70, tier="large", tier_reason="escalated:length"),
        TraceRecord(4.0, 900, 90),
    )
    path = tmp_path / "tiers.jsonl"
    write_trace(path, Trace(TraceHeader(), recs))
    assert read_trace(path).records == recs
    assert main(["trace", "stats", str(path), "--json"]) == 0
    tiers = orjson.loads(capsys.readouterr().out)["tiers"]
    assert tiers["tiers"] == [
        {
            "tier": "small",
            "attempts": 2,
            "input_tokens": 400,
            "output_tokens": 40,
            "mean_score": pytest.approx(0.3),
        },
        {
            "tier": "large",
            "attempts": 2,
            "input_tokens": 1200,
            "output_tokens": 120,
            "mean_score": None,
        },
    ]
    assert tiers["reasons"] == {"escalated": 2, "features": 1, "rule": 1}
    assert tiers["escalations"] == {"length": 2} and tiers["untiered"] == 1
    assert main(["trace", "stats", str(path)]) == 0
    text = capsys.readouterr().out
    assert "tier small       2 attempts (50.0%), 440 tokens, mean score 0.300" in text
    assert "tier large       2 attempts (50.0%), 1,320 tokens" in text
    assert "escalations      length 2" in text
    # A trace without tiers says nothing about them.
    plain = tmp_path / "plain.jsonl"
    write_trace(plain, Trace(TraceHeader(), recs[-1:]))
    assert main(["trace", "stats", str(plain), "--json"]) == 0
    assert orjson.loads(capsys.readouterr().out)["tiers"] is None
