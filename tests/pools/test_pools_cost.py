from __future__ import annotations

from types import MappingProxyType

import pytest
from pools_helpers import settings
from prometheus_client import CollectorRegistry, generate_latest

from gateway.pools.controller import WeightSnapshot
from gateway.pools.cost import ALL_POOLS, BusyTime, CostLedger, Usage, per_thousand
from gateway.pools.metrics import METRICS, register


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_per_thousand() -> None:
    assert per_thousand(0.5, 0) is None
    assert per_thousand(0.5, 2000) == pytest.approx(0.25)


@pytest.mark.parametrize(
    ("intervals", "added"),
    [
        ([(0, 10)], [10]),
        ([(0, 10), (20, 30)], [10, 10]),
        ([(0, 10), (5, 15)], [10, 5]),
        ([(5, 15), (0, 10)], [10, 5]),  # arrives out of order (finished earlier)
        ([(0, 10), (2, 3)], [10, 0]),  # nested: a batched request costs nothing extra
        ([(0, 4), (6, 10), (2, 8)], [4, 4, 2]),  # bridges two spans
        ([(0, 4), (6, 10), (11, 12), (-1, 20)], [4, 4, 1, 12]),
        ([(3, 3)], [0]),
    ],
)
def test_busy_time_is_the_union_of_request_intervals(
    intervals: list[tuple[float, float]], added: list[float]
) -> None:
    busy = BusyTime()
    assert [busy.add(a, b) for a, b in intervals] == pytest.approx(added)
    assert busy.total == pytest.approx(sum(added))


def test_busy_time_forgets_beyond_the_horizon() -> None:
    busy = BusyTime(horizon=100)
    busy.add(0, 10)
    busy.add(500, 510)
    assert busy.add(5, 8) == 3  # forgotten, charged again (documented trade-off)


def test_ledger_per_pool_and_overall() -> None:
    clock = Clock()
    ledger = CostLedger(settings(), {"h200": 2, "domestic": 4}, clock=clock)
    # h200: price 4 x 2 cards = 8/h per replica. domestic: 1 x 2 = 2/h.
    full = Usage(prompt_tokens=9000, cached_tokens=8000, completion_tokens=100)
    ledger.record("h200", "h0", full, 0.0, 36.0)
    ledger.record("h200", "h0", Usage(prompt_tokens=1000, completion_tokens=100), 10.0, 20.0)
    ledger.record("h200", "h1", Usage(), 0.0, 9.0)  # another replica: its own busy time
    ledger.record("domestic", "d0", Usage(prompt_tokens=9000, completion_tokens=100), 0.0, 72.0)
    ledger.record(None, "x", Usage(prompt_tokens=5), 0.0, 1.0)
    ledger.record("unknown", "y", Usage(prompt_tokens=5), 0.0, 1.0)
    clock.t += 1800.0  # half an hour
    s = ledger.summary()
    h, d, all_ = s["h200"], s["domestic"], s[ALL_POOLS]
    assert (h.prompt_tokens, h.cached_tokens, h.completion_tokens, h.requests) == (
        10000,
        8000,
        200,
        3,
    )
    assert h.total_tokens == 10200
    assert h.cost["busy"] == pytest.approx(8.0 * (36 + 9) / 3600)
    assert d.cost["busy"] == pytest.approx(2.0 * 72 / 3600)
    assert h.per_1k_total("busy") == pytest.approx(0.1 / 10.2)
    assert h.per_1k_output("busy") == pytest.approx(0.1 / 0.2)
    assert h.cost["provisioned"] == pytest.approx(8.0 * 2 * 0.5)
    assert d.cost["provisioned"] == pytest.approx(2.0 * 4 * 0.5)
    assert all_.total_tokens == 10200 + 9100 and all_.requests == 4
    assert all_.cost["provisioned"] == pytest.approx(12.0)
    assert all_.per_1k_total("provisioned") == pytest.approx(12.0 / 19.3)
    assert all_.per_1k_output("busy") == pytest.approx((0.1 + 0.04) / 0.3)


def test_replica_count_change_keeps_provisioned_history() -> None:
    clock = Clock()
    ledger = CostLedger(settings(), {"h200": 1}, clock=clock)
    clock.t += 3600
    ledger.set_replica_counts({"h200": 3})
    clock.t += 3600
    assert ledger.summary()["h200"].cost["provisioned"] == pytest.approx(8.0 + 24.0)


def test_throughput_counts_total_tokens_over_the_last_minute() -> None:
    clock = Clock()
    ledger = CostLedger(settings(), {"h200": 1, "domestic": 1}, clock=clock)
    clock.t += 120
    ledger.record("h200", "h0", Usage(prompt_tokens=5900, completion_tokens=100), 0.0, 1.0)
    assert ledger.summary()["h200"].throughput_tps == pytest.approx(100.0)
    clock.t += 61
    assert ledger.summary()["h200"].throughput_tps == 0.0
    assert ledger.summary()["h200"].total_tokens == 6000


def test_empty_ledger_has_no_cost_per_token() -> None:
    s = CostLedger(settings(), {}).summary()
    assert s[ALL_POOLS].per_1k_total("busy") is None


def test_prometheus_export_on_the_given_registry() -> None:
    registry = CollectorRegistry()
    clock = Clock()
    ledger = CostLedger(settings(), {"h200": 1, "domestic": 1}, clock=clock)
    ledger.record(
        "domestic",
        "d0",
        Usage(prompt_tokens=1000, cached_tokens=900, completion_tokens=1000),
        0.0,
        3.6,
    )
    snap = WeightSnapshot(
        MappingProxyType({"h200": 0.3, "domestic": 0.7}),
        MappingProxyType({"h200": 0.1, "domestic": None}),
        code="prefer_cheaper",
        version=3,
        changed_at=5.0,
    )
    register(registry, lambda: snap, ledger)
    text = generate_latest(registry).decode()
    assert 'kvgate_pool_weight{pool="domestic"} 0.7' in text
    assert 'kvgate_pool_utilisation{pool="h200"} 0.1' in text
    assert 'kvgate_pool_utilisation{pool="domestic"}' not in text
    assert "kvgate_pool_weight_changes_total 3.0" in text
    assert 'kvgate_pool_weight_last_change_reason{code="prefer_cheaper"} 1.0' in text
    assert 'kvgate_pool_tokens_total{kind="cached_prompt",pool="domestic"} 900.0' in text
    # 2/h busy for 3.6 s = 0.002 for 2,000 tokens -> 0.001 per 1k total, 0.002 per 1k output
    assert 'kvgate_pool_cost_per_1k_tokens{basis="busy",pool="domestic"} 0.001' in text
    assert 'kvgate_pool_cost_per_1k_output_tokens{basis="busy",pool="all"} 0.002' in text
    assert 'kvgate_pool_cost_per_1k_tokens{basis="busy",pool="h200"}' not in text
    for name in METRICS:
        assert f"# HELP {name}" in text
