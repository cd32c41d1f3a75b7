"""Offline simulation: the engine model behind the real policies, on virtual time."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from gateway.admission.config import EnginePrioritySettings
from gateway.sim.cluster import SimCluster
from gateway.sim.profiles import get_profile
from gateway.trace.cli import main
from gateway.trace.format import Trace, TraceHeader, TraceRecord, write_trace
from gateway.trace.render import Layout
from gateway.trace.replay import Endpoint, replay
from gateway.trace.simulate import SimulationOptions, simulate
from gateway.trace.stats import cluster_hit_rate

BT = 64


def conversations(
    convs: int, turns: int, *, first_blocks: int, growth: int, gap_s: float, out: int = 6
) -> Trace:
    """`convs` interleaved conversations; each turn extends the previous prompt."""
    recs = []
    t = 0.0
    for turn in range(turns):
        for c in range(convs):
            n = first_blocks + growth * turn
            hashes = tuple(c * 100_000 + k for k in range(n))
            recs.append(TraceRecord(t, n * BT, out, hashes, BT))
            t += gap_s
    return Trace(TraceHeader(block_tokens=BT), tuple(recs))


def test_single_engine_hits_match_the_ideal_cache() -> None:
    trace = conversations(2, 3, first_blocks=8, growth=8, gap_s=1.0)
    result = simulate(trace, SimulationOptions(replicas=1))
    report = result.report
    assert report.ok == 6 and report.errors == 0
    # Requests are far apart, so each turn finds the previous turn's whole prompt
    # (512 tokens per earlier turn; 16-token engine blocks divide 64-token trace blocks).
    assert [r.cached_tokens for r in report.results] == [0, 0, 512, 512, 1024, 1024]
    assert report.hit_rate == pytest.approx(cluster_hit_rate(trace, 1, "round_robin").hit_rate)
    assert all(r.output_tokens == 6 and len(r.itl_s) == 5 for r in report.results)
    assert result.simulated_s > 5.0 and result.speed_factor > 1.0


def test_policies_differ_on_the_same_trace() -> None:
    # Three conversations on two replicas: round robin moves each one at every turn.
    trace = conversations(3, 4, first_blocks=8, growth=8, gap_s=0.5)
    sticky = simulate(trace, SimulationOptions(replicas=2, policy="consistent_hash"))
    spread = simulate(trace, SimulationOptions(replicas=2, policy="round_robin"))
    assert sticky.report.hit_rate is not None and spread.report.hit_rate is not None
    assert sticky.report.hit_rate > spread.report.hit_rate
    assert set(spread.report.replica_tokens) == {"r0", "r1"}
    assert spread.report.load_imbalance == pytest.approx(1.0, abs=0.2)
    assert "load imbalance" in sticky.render()


def test_mooncake_sized_blocks_are_rechunked_for_the_engine() -> None:
    # Two 512-token trace blocks shared: 64 engine blocks of 16 tokens.
    header = TraceHeader(block_tokens=512)
    trace = Trace(
        header, (TraceRecord(0.0, 1100, 2, (1, 2, 3), 76), TraceRecord(5.0, 1030, 2, (1, 2, 4), 6))
    )
    result = simulate(trace, SimulationOptions(replicas=1))
    assert [r.cached_tokens for r in result.report.results] == [0, 1024]


def test_requests_an_engine_cannot_hold_are_reported_not_dropped() -> None:
    trace = Trace(
        TraceHeader(block_tokens=BT),
        (
            TraceRecord(0.0, 5 * BT, 2, tuple(range(5)), BT),
            TraceRecord(0.1, 40 * BT, 2, tuple(range(40)), BT),
        ),
    )
    result = simulate(trace, SimulationOptions(replicas=1, profile="tiny"))
    assert result.report.requests == 2
    assert result.report.error_kinds == {"rejected": 1}


async def test_simulation_agrees_with_http_replay() -> None:
    # Few, long prefills: TTFT (about 1 s simulated, 0.5 s wall) dwarfs the HTTP and event
    # loop overhead, which is paid in wall time. Replaying at speedup == time_scale keeps
    # simulated time and trace time aligned, so HTTP TTFT x scale compares with simulate.
    profile = get_profile("h200-sparse").scaled(prefill_tokens_per_s=2000.0)
    trace = conversations(2, 2, first_blocks=32, growth=32, gap_s=1.2)
    scale = 2.0
    async with SimCluster(1, profile, time_scale=scale) as cluster:
        http = await replay(trace, cluster.urls[0], speedup=scale, endpoint="completions")
    sim = simulate(trace, SimulationOptions(replicas=1, profile=profile)).report
    assert http.errors == 0 and sim.errors == 0
    assert http.hit_rate is not None and sim.hit_rate is not None
    assert http.hit_rate == pytest.approx(sim.hit_rate, rel=0.10)
    assert http.ttft_s.p50 * scale == pytest.approx(sim.ttft_s.p50, rel=0.10)


def test_cli_simulate_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, conversations(2, 2, first_blocks=4, growth=4, gap_s=0.5))
    assert (
        main(
            [
                "simulate",
                str(path),
                "--replicas",
                "2",
                "--policy",
                "round_robin",
                "--limit",
                "3",
                "--json",
            ]
        )
        == 0
    )
    out = orjson.loads(capsys.readouterr().out)
    assert out["requests"] == 3 and out["replicas"] == 2 and out["policy"] == "round_robin"
    assert out["speed_factor"] > 0
    assert main(["simulate", str(path), "--profile", "nope"]) == 2
    assert "unknown sim profile" in capsys.readouterr().err


# Each endpoint and each message layout once (13 s of replay apiece on a busy CI host).
@pytest.mark.parametrize(("endpoint", "layout"), [("chat", "turns"), ("completions", "growing")])
async def test_offline_lineage_agrees_with_a_live_replay_through_the_gateway(
    endpoint: Endpoint, layout: Layout
) -> None:
    """Issue 18: `kvgate simulate` routes with the gateway's own lineage rule and placement,
    so on the same agent-shaped trace, replicas and engines, without session ids, its hit
    rate is within 2 points of a replay over HTTP through the gateway."""
    from gateway.testing.servers import gateway
    from gateway.trace.generate import AgentTraceOptions, generate_agent_trace

    trace = generate_agent_trace(
        AgentTraceOptions(
            seed=3, sessions=10, duration_s=4.0, context_scale=0.04, think_s=0.5, block_tokens=16
        )
    ).window(0, 60)
    # Finite KV (evictions happen) and prefill-bound, at 4x simulated speed: at 8x a busy
    # CI host (the whole suite on two cores) let the engines fall behind the replay clock
    # and the live hit rate drifted 3 points below the offline one.
    profile = get_profile("h200-sparse").scaled(num_gpu_blocks=1200, prefill_tokens_per_s=6000.0)
    scale = 4.0
    sim = simulate(
        trace,
        SimulationOptions(
            replicas=4, policy="lineage", profile=profile, max_output_tokens=8, sessions=False
        ),
    ).report
    async with (
        SimCluster(4, profile, time_scale=scale) as cluster,
        gateway(cluster.engines, models={"discover": False}) as gw,
    ):
        live = await replay(
            trace,
            gw.url,
            speedup=scale,
            endpoint=endpoint,
            layout=layout,
            session_header=False,
            max_output_tokens=8,
        )
    assert live.errors == 0 and sim.errors == 0
    assert live.hit_rate is not None and sim.hit_rate is not None
    assert sim.hit_rate > 0.5  # the trace reuses most of its prompts
    print(f"hit rate: live {live.hit_rate:.4f}, simulate {sim.hit_rate:.4f}")
    assert abs(live.hit_rate - sim.hit_rate) <= 0.02, (live.hit_rate, sim.hit_rate)


def test_engine_priority_serves_a_cached_turn_before_queued_new_contexts() -> None:
    """One engine that runs one request at a time: two new 32K-token contexts arrive just
    before the second turn of a conversation whose first turn the engine holds. First come,
    the turn waits for both; shortest uncached prefill first, only for the one running."""
    blocks = 32 * 1024 // BT
    turn1 = tuple(range(64))
    recs = (
        TraceRecord(0.0, len(turn1) * BT, 2, turn1, BT),
        TraceRecord(10.0, blocks * BT, 2, tuple(range(10**6, 10**6 + blocks)), BT),
        TraceRecord(10.001, blocks * BT, 2, tuple(range(2 * 10**6, 2 * 10**6 + blocks)), BT),
        TraceRecord(10.002, (len(turn1) + 8) * BT, 2, (*turn1, *range(500, 508)), BT),
    )
    trace = Trace(TraceHeader(block_tokens=BT), recs)
    one_at_a_time = get_profile("h200-sparse").scaled(max_num_seqs=1)

    def ttfts(order: EnginePrioritySettings | None) -> list[float]:
        opts = SimulationOptions(
            replicas=1, policy="lineage", profile=one_at_a_time, engine_priority=order
        )
        report = simulate(trace, opts).report
        assert report.ok == 4 and report.results[3].cached_tokens == len(turn1) * BT
        return [r.ttft_s or 0.0 for r in report.results]

    fcfs, ordered = ttfts(None), ttfts(EnginePrioritySettings())
    # 32K tokens at 14K tokens/s: a new context's prefill takes over 2 s.
    assert fcfs[3] > 4.0  # behind both new contexts
    assert 2.0 < ordered[3] < 3.0  # behind the running one only
    assert ordered[2] > fcfs[2]  # the second new context waited for the turn


def test_copies_of_a_prompt_in_prefill_wait_for_the_first_one() -> None:
    # One conversation sends its 6,016-token prompt four times at once (n > 1 as separate
    # requests). Sent together, the first takes a whole step (4,096 tokens); the others,
    # admitted beside its last 1,920, find those 4,096 cached and compute the rest each.
    blocks = 94
    hashes = tuple(range(blocks))
    recs = tuple(TraceRecord(0.0, blocks * BT, 4, hashes, BT, session_id="s") for _ in range(4))
    trace = Trace(TraceHeader(block_tokens=BT), recs)
    opts = SimulationOptions(replicas=2, policy="lineage", profile="domestic")
    held = simulate(trace, opts).report
    together = simulate(trace, replace(opts, same_prompt_wait_s=0.0)).report
    cached = sorted(r.cached_tokens or 0 for r in held.results)
    # Once: the three copies find all of it cached but the last token's block.
    assert cached[0] == 0 and all(c >= blocks * BT - 16 for c in cached[1:]), cached
    assert held.hit_rate is not None and together.hit_rate is not None
    assert held.hit_rate > together.hit_rate + 0.15, (held.hit_rate, together.hit_rate)
    # Their first tokens come after the first copy's, and sooner than computed together.
    first = min(r.ttft_s or 0.0 for r in held.results)
    assert all((r.ttft_s or 0.0) >= first for r in held.results)
    assert held.ttft_s.mean < together.ttft_s.mean
