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


@pytest.mark.parametrize(
    ("spec", "gbps"),
    [(" NVLink ", 7200.0), ("100GBPS", 100.0), ("12.5", 12.5), ("pcie5", 512.0), ("3g", 3.0)],
)
def test_link_specs_by_name_or_number(spec: str, gbps: float) -> None:
    assert link_gbps(spec) == gbps


@pytest.mark.parametrize("spec", ["nan", "inf", "-5", "0g", "-0.1gbps"])
def test_link_speeds_that_are_not_a_positive_number_are_refused(spec: str) -> None:
    with pytest.raises(ShapeError, match="positive"):
        link_gbps(spec)


@pytest.mark.parametrize("spec", ["", "fast", "10 gbe", "1e"])
def test_unknown_links_list_the_known_names(spec: str) -> None:
    with pytest.raises(ShapeError, match="nvlink"):
        link_gbps(spec)


def test_transfer_time_grows_with_bytes_and_latency_and_shrinks_with_speed() -> None:
    sizes = [0, 1, 10**6, 10**9, 10**10]
    for link in (10.0, 100.0, 7200.0):
        times = [transfer_seconds(n, link) for n in sizes]
        assert times == sorted(times)
        assert transfer_seconds(10**9, link, 5.0) > transfer_seconds(10**9, link, 0.0)
    speeds = [transfer_seconds(10**9, link) for link in (10.0, 25.0, 100.0, 400.0)]
    assert speeds == sorted(speeds, reverse=True)


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        ({"prompt_tokens": 0}, "at least 1 token"),
        ({"interference": 1.5}, "share"),
        ({"interference": -0.1}, "share"),
        ({"kv_bytes_per_token": 0}, "at least 1"),
    ],
)
def test_a_handoff_that_cannot_be_weighed_is_refused(kwargs: dict[str, float], what: str) -> None:
    args: dict[str, float] = {"prompt_tokens": 1000, **kwargs}
    prompt = int(args.pop("prompt_tokens"))
    with pytest.raises(ShapeError, match=what):
        handoff(get_model("llama-3.1-8b"), prompt, 100.0, **args)  # type: ignore[arg-type]


def test_the_handoff_moves_the_whole_prompt_and_clamps_what_is_cached() -> None:
    model = get_model("llama-3.1-8b")
    h = handoff(model, 4000, 100.0, cached_tokens=10_000)
    assert h.cached_tokens == 4000
    h = handoff(model, 4000, 100.0, kv_bytes_per_token=1000)
    assert h.kv_bytes == 4_000_000
    slower = handoff(model, 4000, 10.0, kv_bytes_per_token=1000)
    assert slower.transfer_s > h.transfer_s


def test_the_benefit_is_the_stall_of_the_uncached_prefill() -> None:
    model = get_model("llama-3.1-8b")
    h = handoff(model, 8000, 400.0, cached_tokens=2000, prefill_tokens_per_s=6000.0)
    assert h.benefit_s == pytest.approx(1.0)  # 6,000 uncached tokens at 6,000 a second
    none = handoff(
        model, 8000, 400.0, cached_tokens=2000, prefill_tokens_per_s=6000.0, interference=0
    )
    assert none.benefit_s == 0.0 and none.outweighed
    assert not none.pays
    # The gateway alone would split (a long uncached prompt, a cheap transfer)...
    assert none.decision.disaggregate
    assert h.pays  # ...and with a second of stall saved, the split pays;
    assert none.reason == "no_benefit"  # with none saved, it does not.
    unweighed = handoff(model, 8000, 400.0)
    assert unweighed.benefit_s is None and not unweighed.outweighed
    assert unweighed.pays is unweighed.decision.disaggregate
