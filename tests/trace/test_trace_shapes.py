"""The co-locating traffic shapes (forks, samples, RAG): determinism and stated statistics."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest

from gateway.trace.cli import main
from gateway.trace.format import Trace, TraceRecord, read_trace
from gateway.trace.shapes import SHAPES, ShapeOptions, generate_shape
from gateway.trace.simulate import SimulationOptions, simulate

SCALE = 0.1


def small(shape: str, seed: int = 3) -> ShapeOptions:
    return ShapeOptions(shape=shape, seed=seed, sessions=16, context_scale=SCALE, block_tokens=64)


def sessions(trace: Trace) -> dict[str, list[TraceRecord]]:
    out: dict[str, list[TraceRecord]] = defaultdict(list)
    for rec in trace.records:
        assert rec.session_id is not None
        out[rec.session_id].append(rec)
    return out


def extends(longer: TraceRecord, shorter: TraceRecord) -> bool:
    """Every full block of `shorter` opens `longer`."""
    full = shorter.block_hashes[: len(shorter.block_hashes) - 1]
    return longer.block_hashes[: len(full)] == full


@pytest.mark.parametrize("shape", SHAPES)
def test_same_options_same_trace_and_seed_matters(shape: str) -> None:
    trace = generate_shape(small(shape))
    assert generate_shape(small(shape)) == trace
    assert generate_shape(small(shape, seed=4)).records != trace.records
    arrivals = [r.arrival_s for r in trace.records]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0


def test_forks_children_start_together_from_the_parents_whole_history() -> None:
    trace = generate_shape(small("forks"))
    by = sessions(trace)
    children = {sid: recs for sid, recs in by.items() if "/" in sid}
    assert children, "no forks"
    forks: dict[tuple[str, str], list[str]] = defaultdict(list)
    for sid in children:
        parent, _, rest = sid.partition("/")
        forks[(parent, rest.split(".")[0])].append(sid)
    sizes = [len(kids) for kids in forks.values()]
    assert min(sizes) >= 1 and max(sizes) <= 4 and max(sizes) > 1
    for (parent, _), kids in forks.items():
        firsts = [by[k][0] for k in kids]
        # All at the same instant, each the parent's latest prompt and more.
        assert len({f.arrival_s for f in firsts}) == 1
        before = [r for r in by[parent] if r.arrival_s <= firsts[0].arrival_s]
        assert before
        for f in firsts:
            assert extends(f, before[-1]) and f.input_tokens > before[-1].input_tokens
            assert 2 <= len(by[f.session_id or ""]) <= 5
        # The parent resumes after its last child's last turn, with its history kept.
        ends = max(by[k][-1].arrival_s for k in kids)
        after = [r for r in by[parent] if r.arrival_s > firsts[0].arrival_s]
        if after:
            assert after[0].arrival_s > ends and extends(after[0], before[-1])
    # Chats under a few shared system prompts are mixed in: short, and not forked.
    mains = [sid for sid in by if "/" not in sid]
    short = [sid for sid in mains if max(r.input_tokens for r in by[sid]) < 1_000 * 5 * SCALE]
    assert len(short) >= 8


def test_forks_at_full_scale_have_deep_histories() -> None:
    trace = generate_shape(ShapeOptions(shape="forks", seed=1, sessions=24))
    by = sessions(trace)
    firsts = [recs[0].input_tokens for sid, recs in by.items() if "/" in sid]
    # Subagents open with the parent's whole history: often 50-90K tokens.
    assert statistics.median(firsts) > 40_000
    assert max(firsts) > 80_000


def test_samples_send_each_turn_n_times_at_once() -> None:
    trace = generate_shape(small("samples"))
    groups: dict[tuple[str, float], list[TraceRecord]] = defaultdict(list)
    for rec in trace.records:
        groups[(rec.session_id or "", rec.arrival_s)].append(rec)
    sampled = [g for (sid, _), g in groups.items() if len(g) > 1]
    assert sampled
    for g in sampled:
        assert 2 <= len(g) <= 8
        assert len({r.block_hashes for r in g}) == 1  # the same prompt
    share = sum(len(g) for g in sampled) / len(trace.records)
    assert share > 0.5


def test_rag_sessions_share_documents() -> None:
    trace = generate_shape(replace(small("rag"), sessions=40))
    by = sessions(trace)
    rag = [recs[0] for recs in by.values() if recs[0].input_tokens > 2_000 * SCALE]
    assert len(rag) >= 30
    # Most popular documents first: many sessions open alike past the system prompt.
    opened: dict[int, int] = defaultdict(int)
    system = min(len(r.block_hashes) for r in rag)
    for r in rag:
        opened[r.block_hashes[system // 2 + 1]] += 1
    assert max(opened.values()) >= len(rag) // 3


def test_cli_writes_each_shape_and_simulate_runs_it(tmp_path: Path) -> None:
    out = tmp_path / "forks.jsonl"
    argv = ["trace", "generate", "-o", str(out), "--shape", "forks", "--sessions", "6"]
    assert main([*argv, "--context-scale", "0.05", "--block-tokens", "64", "--seed", "2"]) == 0
    trace = read_trace(out)
    assert trace.header.source == "generate-forks"
    assert trace == generate_shape(
        ShapeOptions(
            shape="forks",
            seed=2,
            sessions=6,
            context_scale=0.05,
            block_tokens=64,
            think_s=6.0,
            duration_s=600.0,
        )
    )
    # `kvgate simulate` runs it with the live rule (the default policy, no session ids).
    result = simulate(trace, SimulationOptions(replicas=4, policy="lineage", sessions=False))
    assert result.report.errors == 0 and result.unrouted == 0
    assert len(result.report.results) == len(trace.records)
    assert main(["simulate", str(out), "--replicas", "4", "--no-session-ids"]) == 0
    with pytest.raises(SystemExit):  # argparse's usage error
        main(["trace", "generate", "-o", str(out), "--shape", "nope"])
    bad = ["trace", "generate", "-o", str(out), "--shape", "rag", "--sessions", "-1"]
    assert main(bad) == 2
