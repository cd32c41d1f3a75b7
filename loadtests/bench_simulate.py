"""How much faster than real time `kvgate simulate` runs a whole trace.

    python loadtests/bench_simulate.py [--trace PATH] [--replicas 8] [--policy NAME]

Default trace: ../shared/traces/synthetic_trace.jsonl next to the repository. Target: at
least 50x real time on 8 engines. Prints the simulated span, the wall time and the factor.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gateway.trace.format import read_trace
from gateway.trace.simulate import SimulationOptions, simulate

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "synthetic_trace.jsonl"
)
TARGET_FACTOR = 50.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--policy", default="consistent_hash")
    parser.add_argument("--profile", default=None)
    args = parser.parse_args(argv)
    if not args.trace.exists():
        print(f"trace not found: {args.trace}", file=sys.stderr)
        return 2
    trace = read_trace(args.trace)
    result = simulate(
        trace, SimulationOptions(replicas=args.replicas, policy=args.policy, profile=args.profile)
    )
    print(result.render())
    trace_span = trace.records[-1].arrival_s - trace.records[0].arrival_s if trace.records else 0.0
    print(
        f"\ntrace span {trace_span:,.1f} s, simulated until the last request finished"
        f" {result.simulated_s:,.1f} s, wall {result.wall_s:.2f} s"
    )
    verdict = "meets" if result.speed_factor >= TARGET_FACTOR else "MISSES"
    print(
        f"speed factor {result.speed_factor:,.1f}x real time"
        f" ({verdict} the {TARGET_FACTOR:.0f}x target)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
