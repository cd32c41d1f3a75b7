"""`kvgate plan --plot`: legends outside the plotted area, replica axes in whole replicas."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.plan.cards import get_card
from gateway.plan.catalogue import get_model
from gateway.plan.fromtrace import Point, Pool, PoolPlan
from gateway.plan.memory import EngineSettings, budget
from gateway.plan.plots import figure


def points(ttfts: list[float]) -> tuple[Point, ...]:
    return tuple(
        Point(n, t, t / 2, 0.5, 0, 1000.0 * n, 100.0 * n, 0.02 * n, 0.2 * n, 0)
        for n, t in enumerate(ttfts, start=1)
    )


def test_legends_sit_outside_the_axes_and_replica_ticks_are_whole() -> None:
    pytest.importorskip("matplotlib")
    model = get_model("llama-3.1-8b")
    budgets = [budget(model, get_card(c), EngineSettings()) for c in ("h100", "l40s")]
    plans = [
        PoolPlan(Pool(f"{b.card.name}-tp1", b, 2.0), points([9.0, 3.0, 1.5]), None, 2.0, "p90")
        for b in budgets
    ]
    fig: Any = figure(budgets, plans)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    axes = fig.get_axes()
    assert len(axes) == 3
    for ax in axes:
        legend = ax.get_legend()
        assert legend is not None
        # Not over the bars or the curves: the legend's box does not meet the plotting area.
        assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))
    labels = {text.get_text() for text in axes[0].get_legend().get_texts()}
    assert {"gpu_memory_utilization", "card memory", "KV cache"} <= labels
    assert "target 2 s" in {text.get_text() for text in axes[1].get_legend().get_texts()}
    for ax in axes[1:]:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
