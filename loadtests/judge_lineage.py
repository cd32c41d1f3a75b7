"""Issue 45's routing targets, judged from the runs `bench_lineage.py --json` wrote.

    python loadtests/judge_lineage.py without.json with.json [half.json ...]

Every run in the files is grouped by trace, prompt layout and the engines' prefill speed
(each file's `--prefill-speed`), and within a group by router and header. Per group, one
table of medians over the repeats (min..max): hit rate, mean and p99 TTFT (simulated s)
and the imbalance of uncached prompt tokens (max/mean per engine). Then the judged router
(`--router`, default `kvgate`) without a header against the best peer of the group, that
is every router that is not a kvgate, with or without its header (each figure's best may
come from a different peer):

* hit rate at least the best peer's;
* mean and p99 TTFT at most `--ttft-ratio` (0.9) times the lowest peer's;
* under the heavier load (prefill speed below 1): imbalance at most `--imbalance` (1.25).

The medians are compared, so a target met "at the median" may still be missed by single
runs: the ranges are printed beside them. A verdict, not a test: the exit status is 0
whatever the verdicts, 2 when a file cannot be read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# (key in a run's "figures", column title, digits, scale)
FIGURES = (
    ("hit", "hit %", 1, 100.0),
    ("ttft_mean", "mean", 2, 1.0),
    ("ttft_p99", "p99", 2, 1.0),
    ("imbal_unc", "unc imb", 2, 1.0),
)


@dataclass(frozen=True, order=True)
class Group:
    trace: str
    layout: str
    prefill_speed: float

    @property
    def label(self) -> str:
        load = "" if self.prefill_speed >= 1.0 else f", prefill x{self.prefill_speed:g}"
        return f"{self.trace} / {self.layout}{load}"


@dataclass
class Rows:
    # (router, header) -> figure -> one value per run
    values: dict[tuple[str, str], dict[str, list[float]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )


def load(paths: list[Path]) -> dict[Group, Rows]:
    """The runs of every file, grouped; skipped runs and runs without figures left out."""
    groups: dict[Group, Rows] = defaultdict(Rows)
    for path in paths:
        data = json.loads(path.read_text())
        speed = float((data.get("args") or {}).get("prefill_speed") or 1.0)
        for run in data["runs"]:
            if run.get("skipped") or not run.get("figures"):
                continue
            trace, layout, header = (part.strip() for part in run["cell"].split(" / "))
            sent = "with" if header == "with header" else "without"
            rows = groups[Group(trace, layout, speed)].values[(run["router"], sent)]
            for key, _, _, _ in FIGURES:
                value = run["figures"].get(key)
                if value is not None:
                    rows[key].append(float(value))
    return groups


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def cell(values: list[float], digits: int, scale: float) -> str:
    if not values:
        return "-"
    text = f"{median(values) * scale:.{digits}f}"
    if len(values) > 1:
        text += f" ({min(values) * scale:.{digits}f}..{max(values) * scale:.{digits}f})"
    return text


def is_peer(router: str) -> bool:
    return not router.startswith("kvgate")


def verdicts(group: Group, rows: Rows, router: str, ratio: float, bound: float) -> list[str]:
    """One line per target for `router` without a header against the group's best peer."""
    ours = rows.values.get((router, "without"))
    peers = {key: figs for key, figs in rows.values.items() if is_peer(key[0])}
    if not ours:
        return [f"no runs of {router} without a header: nothing judged"]
    if not peers:
        return ["no peer runs: nothing judged"]

    def best(key: str, pick: Any) -> tuple[float, str]:
        scored = [
            (median(figs[key]), f"{name}{', header' if sent == 'with' else ''}")
            for (name, sent), figs in peers.items()
            if figs.get(key)
        ]
        return pick(scored, key=lambda item: item[0]) if scored else (float("nan"), "none")

    lines = []
    hit, hit_by = best("hit", max)
    mine = median(ours["hit"])
    lines.append(_line(mine >= hit, f"hit {mine:.1%} against {hit:.1%} ({hit_by})"))
    for key, name in (("ttft_mean", "mean"), ("ttft_p99", "p99")):
        theirs, by = best(key, min)
        mine = median(ours[key])
        lines.append(
            _line(
                mine <= ratio * theirs,
                f"{name} {mine:.2f} s = {mine / theirs:.3f}x {theirs:.2f} ({by}); "
                f"target {ratio:g}x",
            )
        )
    if group.prefill_speed < 1.0:
        mine = median(ours["imbal_unc"])
        lines.append(_line(mine <= bound, f"imbalance {mine:.2f}; target {bound:g}"))
    return lines


def _line(met: bool, text: str) -> str:
    return f"{'met    ' if met else 'NOT met'}  {text}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("files", nargs="+", type=Path, help="bench_lineage.py --json output")
    parser.add_argument("--router", default="kvgate", help="the router judged (no header)")
    parser.add_argument("--ttft-ratio", type=float, default=0.9)
    parser.add_argument("--imbalance", type=float, default=1.25)
    args = parser.parse_args()
    try:
        groups = load(args.files)
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
        print(f"cannot read the runs: {exc}", file=sys.stderr)
        return 2
    met = total = 0
    for group in sorted(groups):
        rows = groups[group]
        print(f"\n{group.label}")
        head = ["router", "header", "runs", *(title for _, title, _, _ in FIGURES)]
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for (name, sent), figs in sorted(rows.values.items()):
            runs = max((len(v) for v in figs.values()), default=0)
            shown = [cell(figs.get(key, []), digits, scale) for key, _, digits, scale in FIGURES]
            print("| " + " | ".join([name, sent, str(runs), *shown]) + " |")
        for line in verdicts(group, rows, args.router, args.ttft_ratio, args.imbalance):
            print("  " + line)
            if line.startswith(("met", "NOT met")):
                total += 1
                met += line.startswith("met")
    print(f"\n{met} of {total} targets met (medians over the repeats)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
