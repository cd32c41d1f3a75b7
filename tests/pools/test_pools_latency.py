from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from pools_helpers import settings, two_pools

from gateway.hooks import RequestOutcome
from gateway.pools.config import ControllerSettings
from gateway.pools.controller import ControllerState, WeightController, step
from gateway.pools.latency import TtftWindow, with_latency
from gateway.pools.runtime import PoolsRuntime
from gateway.types import ReplicaId

SPECS = {p.name: p for p in settings().pools}


def cfg(**kw: Any) -> ControllerSettings:
    base: dict[str, Any] = {
        "low_watermark": 0.4,
        "high_watermark": 0.7,
        "dwell_steps": 1,
        "max_step": 0.1,
        "ttft_target_s": 0.4,
    }
    base.update(kw)
    return ControllerSettings.model_validate(base)


def test_window_quantile_drops_old_samples_and_unknown_pools() -> None:
    w = TtftWindow(["h200", "domestic"], window_s=10.0)
    for i, v in enumerate([0.1, 0.2, 0.3, 0.4, 5.0]):
        w.add("domestic", float(i), v)
    w.add("nowhere", 0.0, 9.9)
    assert w.quantiles(4.0, 0.5) == {"h200": None, "domestic": 0.3}
    assert w.quantiles(4.0, 1.0)["domestic"] == 5.0
    assert w.quantiles(13.5, 0.5)["domestic"] == 5.0  # only the sample at t=4 is recent
    assert w.quantiles(30.0, 0.5)["domestic"] is None


def test_latency_reads_as_utilisation_reaching_high_at_the_target() -> None:
    util = {"h200": 0.2, "domestic": 0.1, "gone": None}
    out = with_latency(util, {"domestic": 0.4, "h200": 0.01, "gone": 1.0}, 0.4, 0.7)
    assert out == {"h200": 0.2, "domestic": pytest.approx(0.7), "gone": None}
    assert with_latency(util, {}, 0.4, 0.7) == util


def ttft_plant(share: float) -> float:
    """The slow pool's TTFT quantile: prefill queueing grows sharply with its share."""
    return 0.12 + 0.6 * share**3


def run(c: ControllerSettings, latency: bool, steps: int = 40) -> list[dict[str, float]]:
    """Slot-based utilisation of the slow pool stays low at every share (its slots do not
    see prefill queueing); only its TTFT reveals the load."""
    weights: Mapping[str, float] = {"h200": 0.5, "domestic": 0.5}
    state = ControllerState()
    history = []
    for _ in range(steps):
        util: dict[str, float | None] = {
            "h200": 0.3 * weights["h200"],
            "domestic": 0.3 * weights["domestic"],
        }
        if latency:
            assert c.ttft_target_s is not None
            util = with_latency(
                util,
                {"domestic": ttft_plant(weights["domestic"])},
                c.ttft_target_s,
                c.high_watermark,
            )
        result = step(weights, util, SPECS, c, state)
        weights, state = result.weights, result.state
        history.append(dict(weights))
    return history


def test_slot_utilisation_alone_pushes_the_slow_pool_past_its_latency_target() -> None:
    final = run(cfg(), latency=False)[-1]
    assert final["domestic"] == pytest.approx(1.0)
    assert ttft_plant(final["domestic"]) > 0.4


def test_ttft_target_stops_the_shift_before_the_slow_pool_queues() -> None:
    history = run(cfg(), latency=True)
    final = history[-1]
    assert 0.5 < final["domestic"] < 1.0  # still moved toward the cheap pool
    assert all(ttft_plant(h["domestic"]) <= 0.4 for h in history)
    assert history[-10:] == [final] * 10  # settled, no flapping


def test_controller_moves_traffic_off_a_pool_whose_ttft_exceeds_the_target() -> None:
    s = settings(
        controller={"dwell_steps": 1, "max_step": 0.2, "ttft_target_s": 0.4, "smoothing": 1.0}
    )
    ttft: dict[str, float | None] = {"h200": 0.1, "domestic": 0.1}
    ctl = WeightController(s, two_pools, latency_source=lambda: ttft)
    assert ctl.tick().weights["domestic"] == pytest.approx(0.7)  # idle, fast: moves on
    ttft["domestic"] = 0.8  # twice the target: reads as twice the high watermark (0.8)
    snap = ctl.tick()
    assert snap.utilisation["domestic"] == pytest.approx(1.6)
    assert snap.code == "relieve_hot" and snap.weights["domestic"] < 0.7


def test_ttft_is_ignored_without_a_target() -> None:
    s = settings(controller={"dwell_steps": 1, "smoothing": 1.0})
    ctl = WeightController(s, two_pools, latency_source=lambda: {"domestic": 9.0})
    assert ctl.tick().utilisation["domestic"] == pytest.approx(0.0)


def test_runtime_feeds_first_byte_times_of_successful_requests_to_the_controller() -> None:
    view = two_pools()
    now = [100.0]
    rt = PoolsRuntime(
        settings(controller={"dwell_steps": 1, "smoothing": 1.0, "ttft_target_s": 0.5}),
        view.replicas,
        lambda: view,
        ledger_clock=lambda: now[0],
    )

    def outcome(replica: str | None, ttfb: float | None, ok: bool = True) -> RequestOutcome:
        return RequestOutcome(
            request=None,
            request_id="r",
            endpoint="chat",
            status=200,
            replica=None if replica is None else ReplicaId(replica),
            ok=ok,
            stream=True,
            ttfb_s=ttfb,
            latency_s=1.0,
        )

    rt.observe(outcome("domestic-0", 1.0))
    rt.observe(outcome("domestic-1", 9.0, ok=False))  # failures say nothing about queueing
    rt.observe(outcome("h200-0", None))
    rt.observe(outcome(None, 5.0))
    assert rt.ttft.quantiles(now[0], 1.0) == {"h200": None, "domestic": 1.0}
    snap = rt.controller.tick()
    assert snap.utilisation["domestic"] == pytest.approx(0.8 * 1.0 / 0.5)
    assert snap.code == "relieve_hot"


def test_only_mostly_cached_requests_feed_the_guard_when_capped() -> None:
    view = two_pools()
    rt = PoolsRuntime(
        settings(controller={"ttft_target_s": 0.5, "ttft_max_uncached_tokens": 300}),
        view.replicas,
        lambda: view,
        ledger_clock=lambda: 100.0,
    )

    def outcome(ttfb: float, prompt: int | None, cached: int | None) -> RequestOutcome:
        return RequestOutcome(
            request=None,
            request_id="r",
            endpoint="chat",
            status=200,
            replica=ReplicaId("domestic-0"),
            ok=True,
            stream=True,
            prompt_tokens=prompt,
            cached_tokens=cached,
            ttfb_s=ttfb,
            latency_s=1.0,
        )

    rt.observe(outcome(0.9, 3000, 1000))  # a cold prompt: its own prefill, not queueing
    rt.observe(outcome(0.8, None, None))  # size unknown
    assert rt.ttft.quantiles(100.0, 1.0)["domestic"] is None
    rt.observe(outcome(0.2, 3000, 2800))
    rt.observe(outcome(0.1, 250, None))  # nothing cached, but small
    assert rt.ttft.quantiles(100.0, 1.0)["domestic"] == 0.2
    # both requests are still charged
    assert rt.ledger.summary()["domestic"].requests == 4
