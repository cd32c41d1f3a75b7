"""Pool several `bench_pools.py --dump` runs (one per seed) into one verdict.

One run's low-phase p99 is the 2nd-slowest of ~115 requests, and a low phase's cost
depends on which sessions happened to be placed where when it began, so single runs land
on either side of the targets by a few milliseconds or points. Pooled, each phase's p99 is
taken over every seed's requests of that phase (the 1% tail of ~900 in a low phase), and
its cost per 1,000 total tokens over all their tokens. Printed: each seed's verdict, the
spread of the per-seed figures, and the pooled verdict against the same targets (low
phases: at least 20% cheaper at equal or better TTFT p99; peak: no p99 regression).

    python loadtests/pools_pooled.py /tmp/pools-1.json /tmp/pools-2.json ...
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import orjson

LOW_PHASES = ("low", "low-2")
JUDGED = ("low", "peak", "low-2")
VARIANTS = ("static", "dynamic")


def p(values: list[float], q: float) -> float:
    """The benchmark's own estimator (the ceil(n/100)-th slowest at q 0.99)."""
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def figures(runs: list[dict[str, Any]], phase: str) -> tuple[float, float, float, int]:
    """(p99 TTFT, cost per 1k total tokens, share of requests on the pricier pool, n)."""
    ttfts = [
        r["ttft"]
        for run in runs
        for r in run["results"]
        if r["phase"] == phase and r["ttft"] is not None
    ]
    cost = sum(run["cost"][phase]["all"][0] for run in runs)
    tokens = sum(run["cost"][phase]["all"][1] for run in runs)
    served = [r for run in runs for r in run["results"] if r["phase"] == phase]
    pricier = sum(r["pool"] == "h200" for r in served) / max(len(served), 1)
    return p(ttfts, 0.99), cost * 1000 / tokens if tokens else float("nan"), pricier, len(ttfts)


def verdict(
    static: tuple[float, ...], dynamic: tuple[float, ...], phase: str
) -> tuple[float, bool]:
    """(cost saving, target met) from (p99, cost per 1k tokens, ...) of each variant: the
    targets bench_pools.py prints per run, judged here on pooled figures as well."""
    saving = 1 - dynamic[1] / static[1] if static[1] else float("nan")
    met = dynamic[0] <= static[0] and (phase not in LOW_PHASES or saving >= 0.20)
    return saving, met


def main(paths: list[str]) -> None:
    dumps = [orjson.loads(Path(x).read_bytes()) for x in paths]
    dumps = [d for d in dumps if all(v in d["runs"] for v in VARIANTS)]
    if not dumps:
        sys.exit("no dump holds both variants (run bench_pools.py --dump without --dynamic-only)")
    print(f"{len(dumps)} runs, seeds " + ", ".join(str(d["seed"]) for d in dumps))
    print(
        f"\n{'seed':>4}  " + "  ".join(f"{ph + ': cost / p99 dyn vs static':<38}" for ph in JUDGED)
    )
    per_seed: dict[str, list[tuple[float, float, float]]] = {ph: [] for ph in JUDGED}
    all_met = 0
    for d in dumps:
        cells, ok = [], True
        for ph in JUDGED:
            s, y = figures([d["runs"]["static"]], ph), figures([d["runs"]["dynamic"]], ph)
            saving, met = verdict(s, y, ph)
            ok &= met
            per_seed[ph].append((saving, y[0], s[0]))
            cells.append(
                f"{saving:+6.1%} / {y[0]:.3f} vs {s[0]:.3f} s {'met' if met else 'MISSED':<6}"
            )
        all_met += ok
        print(f"{d['seed']:>4}  " + "  ".join(f"{c:<38}" for c in cells))
    print(f"all three targets met in {all_met} of {len(dumps)} runs")
    print("\nper-seed spread (min / median / max):")
    for ph in JUDGED:
        savings, dyn, sta = (sorted(v[i] for v in per_seed[ph]) for i in range(3))
        print(
            f"  {ph:<6} saving {savings[0]:+.1%} / {statistics.median(savings):+.1%} / "
            f"{savings[-1]:+.1%}; p99 dynamic {dyn[0]:.3f} / {statistics.median(dyn):.3f} / "
            f"{dyn[-1]:.3f} s, static {sta[0]:.3f} / {statistics.median(sta):.3f} / "
            f"{sta[-1]:.3f} s"
        )
    print("\n== pooled verdict (every run's requests and tokens together) ==")
    for ph in JUDGED:
        s = figures([d["runs"]["static"] for d in dumps], ph)
        y = figures([d["runs"]["dynamic"] for d in dumps], ph)
        saving, met = verdict(s, y, ph)
        target = ">=20% cheaper, p99 <= static" if ph in LOW_PHASES else "p99 <= static"
        print(
            f"{ph:<6} n {y[3]}/{s[3]}: cost {saving:+.1%} lower, TTFT p99 {y[0]:.3f} vs "
            f"{s[0]:.3f} s, imported share {y[2]:.2f} vs {s[2]:.2f}  target ({target}): "
            f"{'MET' if met else 'NOT MET'}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dumps", nargs="+", help="files written by bench_pools.py --dump")
    main(parser.parse_args().dumps)
