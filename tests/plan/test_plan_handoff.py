"""The PD link budget: the gateway's own pd.auto decision, on the planner's KV sizes."""

from __future__ import annotations

import pytest

from gateway.pd import decision
from gateway.pd.config import ModelPDSettings
from gateway.plan.catalogue import get_model
from gateway.plan.handoff import handoff, link_gbps, transfer_seconds
from gateway.plan.shapes import ShapeError


def test_two_gigabytes_over_10gbe_take_1_6_seconds() -> None:
    assert transfer_seconds(2_000_000_000, link_gbps("10gbe")) == pytest.approx(1.6)
    # NVLink 4 at 900 GB/s: 2 GB in 2.2 ms
    assert transfer_seconds(2_000_000_000, link_gbps("nvlink")) == pytest.approx(2 / 900)
    assert link_gbps("25") == 25.0 and link_gbps("400g") == 400.0
    with pytest.raises(ShapeError, match="unknown link"):
        link_gbps("carrier-pigeon")
    with pytest.raises(ShapeError, match="positive"):
        link_gbps("0")


def test_long_mla_prompt_over_10gbe_stays_colocated() -> None:
    h = handoff(get_model("deepseek-v3"), 100_000, link_gbps("10gbe"))
    assert h.kv_bytes == 100_000 * 70_272  # 7.03 GB
    # pd's default 1 ms fixed cost + 7.0272e9 x 8 / 10e9
    assert h.transfer_s == pytest.approx(0.001 + 7.0272e9 * 8 / 10e9)
    assert not h.pays and h.decision.reason == decision.OVER_BUDGET


def test_uncached_prompt_over_nvlink_splits_and_a_cached_one_does_not() -> None:
    m = get_model("llama-3.1-70b")
    fast = handoff(m, 8000, link_gbps("nvlink"))
    assert fast.pays and fast.decision.reason == decision.PAYS
    assert fast.kv_bytes == 8000 * 327_680
    cached = handoff(m, 8000, link_gbps("nvlink"), cached_tokens=7000)
    assert not cached.pays and cached.decision.reason == decision.MOSTLY_CACHED
    short = handoff(m, 8, link_gbps("nvlink"))
    assert short.decision.reason == decision.SHORT_PROMPT


def test_the_gateways_thresholds_apply() -> None:
    m = get_model("llama-3.1-70b")
    strict = ModelPDSettings(max_transfer_ms=1.0)
    assert handoff(m, 8000, link_gbps("nvlink"), pd=strict).decision.reason == decision.OVER_BUDGET
    loose = ModelPDSettings(max_transfer_ms=10_000.0)
    assert handoff(m, 8000, link_gbps("10gbe"), pd=loose).pays


def test_hybrid_prompt_moves_its_per_sequence_kv() -> None:
    m = get_model("gemma-3-27b")
    h = handoff(m, 100_000, 100.0)
    expected = m.kv_bytes_per_sequence(100_000, "bf16")
    assert h.kv_bytes == pytest.approx(expected, rel=1e-4)
    assert h.kv_bytes < 100_000 * m.layers * 8192 / 4
