"""`kvgate plan --trace`: replicas for a TTFT target via `kvgate simulate`, cost per token."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from gateway.cli import main
from gateway.plan.cards import get_card
from gateway.plan.catalogue import get_model
from gateway.plan.fromtrace import Pool, SimSettings, TraceShape, plan_pool
from gateway.plan.memory import EngineSettings, budget
from gateway.plan.perf import sim_profile
from gateway.trace.format import Trace, TraceHeader, TraceRecord, write_trace

BT = 64


def agent_trace(convs: int = 12, turns: int = 4, gap_s: float = 0.08) -> Trace:
    """Conversations whose every turn extends the last prompt by 1,024 tokens."""
    recs, t = [], 0.0
    for turn in range(turns):
        for c in range(convs):
            n = 64 + 16 * turn  # blocks of 64 tokens: 4,096 + 1,024 per turn
            recs.append(TraceRecord(t, n * BT, 16, tuple(c * 10_000 + k for k in range(n)), BT))
            t += gap_s
    return Trace(TraceHeader(block_tokens=BT), tuple(recs))


def pool(card: str, price: float) -> Pool:
    b = budget(get_model("llama-3.1-8b"), get_card(card), EngineSettings(max_model_len=32768))
    return Pool(card, b, price)


def test_replicas_for_a_target_and_total_token_cost() -> None:
    trace = agent_trace()
    loose = plan_pool(trace, pool("h100", 2.0), 5.0, sim=SimSettings(max_replicas=8))
    tight = plan_pool(trace, pool("h100", 2.0), 0.3, sim=SimSettings(max_replicas=8))
    assert loose.needed is not None and tight.needed is not None
    assert tight.needed.replicas > loose.needed.replicas
    assert tight.needed.ttft_s <= 0.3 and tight.needed.errors == 0
    # One fewer replica misses the target (the search bisected down to the first that meets).
    fewer = [p for p in tight.points if p.replicas == tight.needed.replicas - 1]
    assert fewer and fewer[0].ttft_s > 0.3
    p = tight.needed
    # $2/card-hour x cards / (total tok/s x 3600 s) x 1e6
    assert p.cost_per_m_total == pytest.approx(
        2.0 * p.replicas / (p.total_tokens_per_s * 3600) * 1e6
    )
    shape = TraceShape.of(trace)
    assert p.cost_per_m_output == pytest.approx(
        p.cost_per_m_total * (shape.total_input + shape.total_output) / shape.total_output
    )
    assert p.hit_rate is not None and p.hit_rate > 0.5  # turns extend cached prompts


def test_the_slower_card_needs_at_least_as_many_replicas() -> None:
    trace = agent_trace()
    fast = plan_pool(trace, pool("h100", 2.0), 1.0, sim=SimSettings(max_replicas=16))
    slow = plan_pool(trace, pool("ascend-910b", 1.0), 1.0, sim=SimSettings(max_replicas=16))
    assert fast.needed is not None and slow.needed is not None
    # h100: 1 replica 1.25 s, 2 replicas 0.22 s; 910B: 2 replicas 3.1 s, 4 replicas 0.75 s
    assert (fast.needed.replicas, slow.needed.replicas) == (2, 4)


def test_sim_profile_carries_the_budget() -> None:
    b = pool("h100", 1.0).budget
    prof = sim_profile(b, name="x", context=8192)
    assert prof.num_gpu_blocks == b.kv_blocks  # dense: per-token KV does not depend on length
    assert prof.max_num_batched_tokens == 8192 and prof.max_model_len == 32768
    # 24.7K tok/s: 989 TFLOPS x 0.4 / (2 x 8.03e9)
    assert prof.prefill_tokens_per_s == pytest.approx(989e12 * 0.4 / (2 * 8.03e9))


def test_unmet_target_is_reported() -> None:
    plan = plan_pool(
        agent_trace(convs=4, turns=2), pool("l40s", 1.0), 0.001, sim=SimSettings(max_replicas=2)
    )
    assert plan.needed is None and [p.replicas for p in plan.points] == [1, 2]


def test_cli_compares_two_pools(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, agent_trace())
    code = main(
        [
            "plan",
            "llama-3.1-8b",
            "--card",
            "h100",
            "--max-model-len",
            "32768",
            "--trace",
            str(path),
            "--ttft",
            "1",
            "--price",
            "2",
            "--compare",
            "card=ascend-910b,price=0.9,label=domestic",
            "--json",
        ]
    )
    out = orjson.loads(capsys.readouterr().out)
    assert code == 0
    pools = {p["pool"]: p for p in out["trace"]["pools"]}
    assert set(pools) == {"h100-tp1", "domestic"}
    assert pools["domestic"]["price_per_card_hour"] == 0.9
    assert all(p["needed"]["ttft_p90_s"] <= 1 for p in pools.values())
    assert out["trace"]["shape"]["requests"] == 48
    code = main(["plan", "llama-3.1-8b", "--trace", str(path), "--compare", "tp=2"])
    assert code == 2 and "names no card" in capsys.readouterr().err


def test_requests_over_the_context_do_not_block_the_target() -> None:
    base = agent_trace(convs=4, turns=2)
    huge = TraceRecord(base.records[-1].arrival_s + 0.1, 40_000, 4, (), BT)
    trace = Trace(base.header, (*base.records, huge))
    plan = plan_pool(trace, pool("h100", 1.0), 5.0, sim=SimSettings(max_replicas=4))
    assert plan.too_long == 1  # 40,004 tokens > max_model_len 32,768
    assert plan.needed is not None and plan.needed.errors == 1


def test_an_impossible_pool_is_not_simulated() -> None:
    b = budget(get_model("deepseek-v3"), get_card("ascend-910b"), EngineSettings(tp=16))
    plan = plan_pool(agent_trace(convs=2, turns=1), Pool("910b", b, 1.0), 1.0)
    assert plan.needed is None and plan.points == ()
    assert plan.impossible and "fp8" in plan.impossible[0]
