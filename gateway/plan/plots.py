"""`kvgate plan --plot FILE.png` (needs the `plots` extra): the memory budget bar of each
pool's card and, with `--trace`, TTFT and cost against the replica count."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.plan.fromtrace import PoolPlan
from gateway.plan.memory import Budget
from gateway.trace.plots import _pyplot

_PARTS = (
    ("weights", "weights_gib", "#4c72b0"),
    ("activations", "activation_gib", "#dd8452"),
    ("CUDA graphs", "cuda_graph_gib", "#c44e52"),
    ("runtime", "runtime_gib", "#8172b3"),
)


def write_plot(path: str | Path, budgets: Sequence[Budget], plans: Sequence[PoolPlan] = ()) -> Path:
    plt = _pyplot()
    fig = figure(budgets, plans)
    out = Path(path)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def figure(budgets: Sequence[Budget], plans: Sequence[PoolPlan] = ()) -> Any:
    """The matplotlib Figure: legends below their axes (never over the bars), replica axes
    in whole replicas."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    cols = 3 if plans else 1
    fig, axes = plt.subplots(1, cols, figsize=(5.5 * cols, 4.2), squeeze=False)
    ax = axes[0][0]
    labels = [f"{b.card.name} x{b.settings.tp}" for b in budgets]
    bottoms = [0.0] * len(budgets)
    for name, attr, colour in _PARTS:
        values = [getattr(b, attr) for b in budgets]
        ax.bar(labels, values, bottom=bottoms, label=name, color=colour)
        bottoms = [x + v for x, v in zip(bottoms, values, strict=True)]
    kv = [max(0.0, b.kv_gib) for b in budgets]
    ax.bar(labels, kv, bottom=bottoms, label="KV cache", color="#55a868")
    for i, b in enumerate(budgets):
        first = i == 0
        ax.hlines(
            b.usable_gib,
            i - 0.4,
            i + 0.4,
            colors="black",
            linestyles="dashed",
            label="gpu_memory_utilization" if first else None,
        )
        ax.hlines(
            b.card.memory_gib,
            i - 0.4,
            i + 0.4,
            colors="grey",
            label="card memory" if first else None,
        )
    ax.set_ylabel("GiB per card")
    ax.set_title("memory budget per card")
    _legend_below(ax)
    if plans:
        for plan in plans:
            xs = [p.replicas for p in plan.points]
            axes[0][1].plot(xs, [p.ttft_s for p in plan.points], marker="o", label=plan.pool.label)
            costed = [p for p in plan.points if p.cost_per_m_total is not None]
            if costed:
                axes[0][2].plot(
                    [p.replicas for p in costed],
                    [p.cost_per_m_total for p in costed],
                    marker="o",
                    label=plan.pool.label,
                )
        target = plans[0].target_ttft_s
        axes[0][1].axhline(target, color="grey", linestyle="dashed", label=f"target {target:g} s")
        axes[0][1].set_yscale("log")
        axes[0][1].set_ylabel(f"TTFT {plans[0].percentile}, s")
        axes[0][2].set_ylabel("$ per million total tokens")
        for replicas in (axes[0][1], axes[0][2]):
            replicas.set_xlabel("replicas")
            replicas.xaxis.set_major_locator(MaxNLocator(integer=True))
            _legend_below(replicas)
    fig.tight_layout()
    return fig


def _legend_below(ax: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
