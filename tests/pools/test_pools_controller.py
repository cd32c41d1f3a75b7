from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Mapping
from typing import Any

import pytest
from pools_helpers import settings, two_pools

from gateway.pools.config import ControllerSettings, PoolsSettings
from gateway.pools.controller import (
    ControllerState,
    WeightController,
    initial_weights,
    smooth,
    step,
)
from gateway.types import ClusterView, EngineLoad, ReplicaId, ReplicaState

SPECS = {p.name: p for p in settings().pools}
CAPACITY = {"h200": 60.0, "domestic": 30.0}  # slots; the cheap pool is half the size


def cfg(**kw: Any) -> ControllerSettings:
    base: dict[str, Any] = {
        "low_watermark": 0.5,
        "high_watermark": 0.8,
        "hysteresis": 0.05,
        "dwell_steps": 2,
        "max_step": 0.1,
    }
    base.update(kw)
    return ControllerSettings.model_validate(base)


def plant(demand: float, weights: Mapping[str, float]) -> dict[str, float | None]:
    """Utilisation each pool would show if `demand` slots of work split by `weights`."""
    return {p: demand * weights[p] / CAPACITY[p] for p in CAPACITY}


def run(series: list[float], c: ControllerSettings, noise: float = 0.0) -> list[dict[str, float]]:
    weights: Mapping[str, float] = {"h200": 0.5, "domestic": 0.5}
    state = ControllerState()
    history = []
    for i, demand in enumerate(series):
        util = plant(demand, weights)
        if noise:
            util = {p: (u or 0) + noise * math.sin(i * 1.7 + len(p)) for p, u in util.items()}
        result = step(weights, util, SPECS, c, state)
        weights, state = result.weights, result.state
        history.append(dict(weights))
    return history


def reversals(values: list[float]) -> int:
    deltas = [b - a for a, b in itertools.pairwise(values) if abs(b - a) > 1e-9]
    return sum(1 for a, b in itertools.pairwise(deltas) if (a > 0) != (b > 0))


def test_low_load_moves_traffic_to_the_cheaper_pool_then_settles() -> None:
    history = run([6.0] * 40, cfg())
    dom = [h["domestic"] for h in history]
    assert dom[0] == 0.5 and dom[1] == pytest.approx(0.6)  # dwell of 2 steps, then one step
    assert dom[-1] == pytest.approx(1.0)
    assert all(abs(b - a) <= 0.1 + 1e-9 for a, b in itertools.pairwise(dom))
    assert reversals(dom) == 0


def test_weights_converge_inside_the_band_without_oscillating() -> None:
    # 20 slots of work: the cheap pool fills until its utilisation enters the band.
    dom = [h["domestic"] for h in run([20.0] * 60, cfg())]
    assert dom[-1] == pytest.approx(0.8)
    assert 0.5 <= 20.0 * dom[-1] / CAPACITY["domestic"] <= 0.8
    assert reversals(dom) == 0
    assert len(set(dom[-20:])) == 1


def test_ramp_up_and_down_follows_load_with_bounded_reversals() -> None:
    series = [6.0] * 30 + [40.0] * 40 + [70.0] * 30 + [6.0] * 40
    history = run(series, cfg(), noise=0.04)
    dom = [h["domestic"] for h in history]
    assert dom[29] > 0.9, "cheap pool takes the low-load phase"
    peak_util = 70.0 * dom[99] / CAPACITY["domestic"]
    other_util = 70.0 * (1 - dom[99]) / CAPACITY["h200"]
    assert abs(peak_util - other_util) < 0.2, "peak balances utilisation across pools"
    assert dom[-1] > 0.9, "back to the cheap pool when load falls"
    # one reversal into the peak and one out of it, not a flap per sample
    assert reversals(dom) <= 3
    # no weight ever moves more than max_step at once
    assert max(abs(b - a) for a, b in itertools.pairwise(dom)) <= 0.1 + 1e-9


def test_hysteresis_needs_extra_margin_to_reverse_the_last_move() -> None:
    c = cfg(dwell_steps=1)
    w = {"h200": 0.4, "domestic": 0.6}
    last_toward_cheap = ControllerState(last_move=("h200", "domestic"))
    just_over = {"h200": 0.2, "domestic": 0.83}
    held = step(w, just_over, SPECS, c, last_toward_cheap)
    assert not held.moved
    fresh = step(w, just_over, SPECS, c, ControllerState())
    assert fresh.moved and fresh.weights["domestic"] == pytest.approx(0.5)
    clear = step(w, {"h200": 0.2, "domestic": 0.86}, SPECS, c, last_toward_cheap)
    assert clear.moved and clear.code == "relieve_hot"


def test_one_sample_spike_does_not_move_weights_with_a_relieve_dwell() -> None:
    series = [20.0] * 10 + [80.0] + [20.0] * 10
    weights: Mapping[str, float] = {"h200": 0.0, "domestic": 1.0}
    state = ControllerState()
    for demand in series:
        result = step(weights, plant(demand, weights), SPECS, cfg(relieve_dwell_steps=2), state)
        assert not result.moved, result.reason
        state = result.state


def test_overload_is_relieved_at_once_by_default_but_underuse_waits() -> None:
    hot = step({"h200": 0.0, "domestic": 1.0}, {"h200": 0.0, "domestic": 0.9}, SPECS, cfg())
    assert hot.moved and hot.code == "relieve_hot"
    idle = step({"h200": 0.5, "domestic": 0.5}, {"h200": 0.1, "domestic": 0.1}, SPECS, cfg())
    assert not idle.moved and idle.reason.startswith("waiting (1/2)")


def test_moves_never_overshoot_a_linear_plant() -> None:
    # equalising: 0.9 at share 0.5 vs 0.5 at share 0.5 -> equal at a = 0.4 / (1.8 + 1.0)
    r = step(
        {"h200": 0.5, "domestic": 0.5},
        {"h200": 0.5, "domestic": 0.9},
        SPECS,
        cfg(dwell_steps=1, max_step=0.5),
    )
    assert r.weights["domestic"] == pytest.approx(0.5 - 0.4 / 2.8, abs=1e-6)
    # filling the cheap pool stops at mid-band (0.65): 0.2 at share 0.5 -> share 1.625 capped
    r = step(
        {"h200": 0.5, "domestic": 0.5},
        {"h200": 0.1, "domestic": 0.4},
        SPECS,
        cfg(dwell_steps=1, max_step=0.5),
    )
    assert r.weights["domestic"] == pytest.approx(0.5 * 0.65 / 0.4, abs=1e-6)
    # already at the target: hold instead of a crumb of a move
    r = step(
        {"h200": 0.5, "domestic": 0.5},
        {"h200": 0.1, "domestic": 0.499},
        SPECS,
        cfg(dwell_steps=1, low_watermark=0.5, high_watermark=0.5004),
    )
    assert not r.moved


def test_pool_without_healthy_replicas_neither_gives_nor_takes() -> None:
    result = step(
        {"h200": 0.5, "domestic": 0.5}, {"h200": 0.1, "domestic": None}, SPECS, cfg(dwell_steps=1)
    )
    assert not result.moved


def test_min_weight_is_a_floor() -> None:
    history = run([3.0] * 30, cfg(min_weight=0.1))
    assert history[-1]["h200"] == pytest.approx(0.1)


def test_initial_weights_are_normalised() -> None:
    s = settings(initial_weights={"h200": 3, "domestic": 1})
    assert initial_weights(s) == {"h200": 0.75, "domestic": 0.25}
    assert initial_weights(settings()) == {"h200": 0.5, "domestic": 0.5}


def _loaded_view(domestic_running: float) -> ClusterView:
    reps = []
    for r in two_pools().replicas:
        running = domestic_running if r.pool == "domestic" else 0.0
        reps.append(
            ReplicaState(
                id=r.id,
                url=r.url,
                models=r.models,
                pool=r.pool,
                load=EngineLoad(waiting=0.0, running=running, scraped_at=99.0),
            )
        )
    return ClusterView(replicas=tuple(reps), now=100.0)


def test_controller_tick_publishes_snapshots_with_reason() -> None:
    s: PoolsSettings = settings(controller={"dwell_steps": 1, "max_step": 0.25})
    seen: list[Any] = []
    ctl = WeightController(s, lambda: _loaded_view(1.0), clock=lambda: 42.0, on_publish=seen.append)
    first = ctl.snapshot
    snap = ctl.tick()
    assert snap is ctl.snapshot and snap is not first
    assert dict(snap.weights) == {"h200": 0.25, "domestic": 0.75}
    assert snap.code == "prefer_cheaper" and "below low watermark" in snap.reason
    assert snap.version == 1 and snap.changed_at == 42.0
    assert snap.utilisation["domestic"] == pytest.approx(0.1)
    assert dict(first.weights) == {"h200": 0.5, "domestic": 0.5}, "snapshots are immutable"
    assert [x.version for x in seen] == [0, 1]


def test_disabled_controller_keeps_static_weights() -> None:
    s = settings(controller={"enabled": False})
    ctl = WeightController(s, lambda: _loaded_view(0.0))
    for _ in range(5):
        snap = ctl.tick()
    assert dict(snap.weights) == {"h200": 0.5, "domestic": 0.5} and snap.version == 0


async def test_background_task_steps_and_stops() -> None:
    s = settings(controller={"interval_s": 0.01, "dwell_steps": 1})
    ctl = WeightController(s, lambda: _loaded_view(0.0))
    ctl.start()
    for _ in range(200):
        await asyncio.sleep(0.01)
        if ctl.snapshot.weights["domestic"] == 1.0:
            break
    await ctl.stop()
    assert ctl.snapshot.weights["domestic"] == 1.0
    steps = ctl.snapshot.steps
    await asyncio.sleep(0.05)
    assert ctl.snapshot.steps == steps


def test_replica_ids_are_typed() -> None:
    assert _loaded_view(0.0).by_id[ReplicaId("h200-0")].pool == "h200"


def test_smoothing_is_an_ewma_that_restarts_after_a_gap() -> None:
    assert smooth({"a": 0.0, "b": 0.5}, {"a": 1.0, "b": None}, 0.25) == {"a": 0.25, "b": None}
    assert smooth({"b": None}, {"b": 0.8}, 0.25) == {"b": 0.8}


def test_controller_decides_on_smoothed_utilisation() -> None:
    s = settings(controller={"dwell_steps": 1, "smoothing": 0.5})
    running = [1.0]
    ctl = WeightController(s, lambda: _loaded_view(running[0]))
    assert ctl.tick().utilisation["domestic"] == pytest.approx(0.1)
    running[0] = 9.0
    assert ctl.tick().utilisation["domestic"] == pytest.approx(0.5)


def test_refilling_a_pool_the_last_move_relieved_waits_return_dwell_steps() -> None:
    c = cfg(dwell_steps=1, return_dwell_steps=3)
    w = {"h200": 0.6, "domestic": 0.4}
    cool = {"h200": 0.1, "domestic": 0.2}
    state = ControllerState(last_move=("domestic", "h200"), last_code="relieve_hot")
    for i in range(2):
        r = step(w, cool, SPECS, c, state)
        assert not r.moved and r.reason.startswith(f"waiting ({i + 1}/3)"), r.reason
        state = r.state
    r = step(w, cool, SPECS, c, state)
    assert r.moved and r.code == "prefer_cheaper"
    # a fill that follows a fill (not a relief) keeps the ordinary dwell
    r2 = step(r.weights, cool, SPECS, c, r.state)
    assert r2.moved and r2.state.last_code == "prefer_cheaper"


def lagged_run(c: ControllerSettings, steps: int = 100, lag: int = 4) -> list[float]:
    """Weights steer new sessions only: the cheap pool's load follows its share `lag` steps
    late (1.6 at full share, so it must not take everything)."""
    weights: Mapping[str, float] = {"h200": 0.9, "domestic": 0.1}
    state = ControllerState()
    shares = [0.1] * lag
    history = []
    for _ in range(steps):
        late = shares[-lag]
        util: dict[str, float | None] = {"h200": 0.3 * (1 - late), "domestic": 1.6 * late}
        result = step(weights, util, SPECS, c, state)
        weights, state = result.weights, result.state
        shares.append(weights["domestic"])
        history.append(weights["domestic"])
    return history


def test_each_move_waits_its_own_dwell_so_a_lagging_load_settles() -> None:
    dom = lagged_run(cfg(dwell_steps=2, max_step=0.15))
    assert dom[1] == pytest.approx(0.25) and dom[2] == pytest.approx(0.25)  # one move per dwell
    # one overshoot into the band's top and back (the load shows each move 4 steps late),
    # then it stays put; moving every step once dwelled, it kept cycling (12 reversals)
    assert reversals(dom) <= 2
    assert dom[-50:] == [dom[-1]] * 50, "settled"
    assert 0.5 <= 1.6 * dom[-1] <= 0.8, "inside the band"
    assert all(abs(b - a) <= 0.15 + 1e-9 for a, b in itertools.pairwise(dom))
