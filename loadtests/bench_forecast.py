"""Cost of the per-request cache forecast (gateway.forecast) the proxy takes at dispatch:
the router's estimate on the chosen replica and on the head of its ranking, for the default
policy at 8, 64 and 512 replicas on bench_decision's workload (256-token blocks, prompts
of 100K tokens growing turn by turn). Prints microseconds per request (p50 / p99 / mean)
beside the decision itself.

    python loadtests/bench_forecast.py [--requests 2000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decision import Workload, make_replicas, make_view

from gateway.forecast import forecast
from gateway.policy import PolicyContext, TracksPrefill
from gateway.routing import RoutingSettings, build_router


def run(replicas: int, requests: int) -> dict[str, float]:
    rng = random.Random(7)
    states = make_replicas(replicas, 500_000)
    router = build_router(RoutingSettings(policy="lineage"), PolicyContext(replicas=states))
    work = Workload(rng, 400, 256)
    view = make_view(states, rng, 100.0)
    estimate = router.cached_tokens  # type: ignore[attr-defined]
    prefill = router if isinstance(router, TracksPrefill) else None
    choose_us: list[float] = []
    forecast_us: list[float] = []
    for _ in range(requests):
        req = work.next()
        t0 = time.perf_counter_ns()
        choice = router.choose(req, view)
        target = choice.first
        t1 = time.perf_counter_ns()
        assert target is not None
        forecast(estimate, req, target, choice.ranked, "lineage")
        t2 = time.perf_counter_ns()
        if prefill is not None:
            prefill.dispatched(req, target)
        router.placed(req, target)  # type: ignore[attr-defined]
        if prefill is not None:
            prefill.prefilled(req)
        choose_us.append((t1 - t0) / 1000.0)
        forecast_us.append((t2 - t1) / 1000.0)
    q = statistics.quantiles(forecast_us, n=100)
    return {
        "choose_p50": statistics.median(choose_us),
        "p50": q[49],
        "p99": q[98],
        "mean": statistics.fmean(forecast_us),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    args = ap.parse_args()
    print(f"{'replicas':>8} {'choose p50 us':>14} {'forecast p50':>13} {'p99':>9} {'mean':>9}")
    for n in (8, 64, 512):
        r = run(n, args.requests)
        print(
            f"{n:>8} {r['choose_p50']:>14.1f} {r['p50']:>13.1f} {r['p99']:>9.1f} {r['mean']:>9.1f}"
        )


if __name__ == "__main__":
    main()
