"""`kvgate plan --plot FILE.png` (needs the `plots` extra): the memory budget bar of each
pool's card and, with `--trace`, TTFT and cost against the replica count."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

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
        ax.hlines(b.usable_gib, i - 0.4, i + 0.4, colors="black", linestyles="dashed")
        ax.hlines(b.card.memory_gib, i - 0.4, i + 0.4, colors="grey")
    ax.set_ylabel("GiB per card (dashed: gpu_memory_utilization)")
    ax.set_title("memory budget per card")
    ax.legend(fontsize="small")
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
        axes[0][1].axhline(plans[0].target_ttft_s, color="grey", linestyle="dashed")
        axes[0][1].set_yscale("log")
        axes[0][1].set_xlabel("replicas")
        axes[0][1].set_ylabel(f"TTFT {plans[0].percentile}, s")
        axes[0][1].legend(fontsize="small")
        axes[0][2].set_xlabel("replicas")
        axes[0][2].set_ylabel("$ per million total tokens")
        axes[0][2].legend(fontsize="small")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
