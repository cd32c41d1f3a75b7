"""Optional PNG plots for `kvgate trace stats --plots DIR` (needs the `plots` extra)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.errors import ConfigError
from gateway.trace.format import Trace
from gateway.trace.stats import hit_rate

DEFAULT_SWEEP = (10_000, 30_000, 100_000, 300_000, 1_000_000, 3_000_000, 10_000_000, 30_000_000)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("plots need matplotlib: pip install 'kvgate[plots]'") from exc
    return plt


def write_plots(
    trace: Trace, out_dir: str | Path, sweep: Sequence[int] = DEFAULT_SWEEP
) -> list[Path]:
    """Context-length CDF and hit rate against LRU cache size; returns the files written."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    lengths = sorted(r.input_tokens for r in trace.records)
    fig, ax = plt.subplots(figsize=(6, 4))
    n = len(lengths)
    ax.plot(lengths, [(i + 1) / n for i in range(n)])
    ax.set_xscale("log")
    ax.set_xlabel("input tokens")
    ax.set_ylabel("share of requests")
    ax.set_title("context length CDF")
    ax.grid(True, alpha=0.3)
    path = out / "context_length_cdf.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    written.append(path)

    if any(r.block_hashes for r in trace.records):
        rates = [hit_rate(trace, size) for size in sweep]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(list(sweep), rates, marker="o", label="LRU")
        ax.axhline(hit_rate(trace), linestyle="--", color="grey", label="infinite")
        ax.set_xscale("log")
        ax.set_xlabel("cache size (tokens)")
        ax.set_ylabel("prefix hit rate")
        ax.set_ylim(0, 1)
        ax.legend()
        ax.grid(True, alpha=0.3)
        path = out / "hit_rate_vs_cache_size.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written
