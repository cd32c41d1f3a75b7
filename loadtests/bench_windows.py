"""kvgate's default routing beside the Rust routers' `cache_aware` rule on many trace
windows, offline: one live replay (bench_lineage.py) judges one window of the synthetic
trace and one agent seed; this runs `kvgate simulate` (the same engine model, 8 engines of
`--blocks` KV, outputs capped at 1024 tokens, no session ids) over several of each in a
minute, at the arrival speeds bench_lineage.py replays them at.

    python loadtests/bench_windows.py [--starts 500,1000,...] [--agent-seeds 1,2,3,4]
        [--shape-seeds 1,2,3] [--policies lineage,cache_aware] [--sessions]
        [--config-a JSON] [--config-b JSON]

`--shape-seeds` adds the issue-45 shapes (`kvgate trace generate --shape` forks, samples
and rag, as bench_lineage.py generates them) for those seeds; `--config-a/-b` give either
policy its settings as JSON, so one policy can be compared with itself under another
setting (`--policies lineage,lineage --config-b '{"cache_weight": 8}'`).

Per window and policy: mean and p99 TTFT (simulated seconds) and token-weighted hit rate;
then the first policy's over the second's per window and their geometric mean per trace.
`cache_aware` (plugins/cache_aware.py) follows the Rust routers' documented rule. The
ratios flatter the first policy against the live ones (docs/routing.md: on #2993 0.84
here, 0.92 live against sglang-router; on #1500 0.59 here, 0.78 live): read them for which
windows are hard, and judge with bench_lineage.py.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from bench_lineage import (
    AGENT_DURATION_S,
    AGENT_SESSIONS,
    BLOCKS,
    MAX_OUTPUT_TOKENS,
    SHAPE_DURATION_S,
    SHAPE_SESSIONS,
    TRACE,
    TRACE_DEFAULTS,
    Defaults,
)

from gateway.sim.profiles import get_profile
from gateway.trace.format import Trace, read_trace
from gateway.trace.generate import AgentTraceOptions, generate_agent_trace
from gateway.trace.shapes import SHAPES, ShapeOptions, generate_shape
from gateway.trace.simulate import SimulationOptions, simulate


def simulated_speedup(d: Defaults) -> float:
    """bench_lineage.py's replay speed over its engines' time scale: the arrival speed in
    simulated time."""
    return d.speedup / d.time_scale


SYNTHETIC_SPEEDUP = simulated_speedup(TRACE_DEFAULTS["synthetic"])
AGENT_SPEEDUP = simulated_speedup(TRACE_DEFAULTS["agent"])


@dataclass(frozen=True)
class Figures:
    mean: float
    p99: float
    hit: float

    def cell(self) -> str:
        return f"{self.mean:.2f}/{self.p99:.2f}/{self.hit:.1%}"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _config(text: str) -> dict[str, object]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a policy config is a JSON object")
    return value


def run(
    trace: Trace, policy: str, config: dict[str, object], speedup: float, args: argparse.Namespace
) -> Figures:
    profile = get_profile("h200-sparse").scaled(num_gpu_blocks=args.blocks)
    options = SimulationOptions(
        replicas=args.replicas,
        policy=policy,
        policy_config=config,
        profile=profile,
        speedup=speedup,
        max_output_tokens=MAX_OUTPUT_TOKENS,
        sessions=args.sessions,
    )
    report = simulate(trace, options).report
    return Figures(report.ttft_s.mean, report.ttft_s.p99, report.hit_rate or 0.0)


def windows(args: argparse.Namespace) -> list[tuple[str, str, Trace, float]]:
    out: list[tuple[str, str, Trace, float]] = []
    if args.trace.exists():
        whole = read_trace(args.trace)
        for start in args.starts:
            window = whole.window(start, args.requests)
            out.append(("synthetic", f"#{start}", window, SYNTHETIC_SPEEDUP))
    else:
        print(f"trace not found: {args.trace}; synthetic windows skipped", file=sys.stderr)
    for seed in args.agent_seeds:
        opts = AgentTraceOptions(seed=seed, sessions=AGENT_SESSIONS, duration_s=AGENT_DURATION_S)
        agent = generate_agent_trace(opts).window(0, args.agent_requests)
        out.append(("agent", f"seed {seed}", agent, AGENT_SPEEDUP))
    for shape in SHAPES:
        for seed in args.shape_seeds:
            opts = ShapeOptions(
                shape=shape, seed=seed, sessions=SHAPE_SESSIONS, duration_s=SHAPE_DURATION_S
            )
            trace = generate_shape(opts).window(0, args.shape_requests)
            out.append((shape, f"seed {seed}", trace, AGENT_SPEEDUP))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--starts", type=_ints, default=[500, 1000, 1500, 2000, 2500, 2993])
    ap.add_argument(
        "--requests", type=int, default=TRACE_DEFAULTS["synthetic"].requests, help="per window"
    )
    ap.add_argument("--agent-seeds", type=_ints, default=[1, 2, 3, 4])
    ap.add_argument("--agent-requests", type=int, default=TRACE_DEFAULTS["agent"].requests)
    ap.add_argument("--policies", default="lineage,cache_aware", help="two, compared first/second")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=BLOCKS, help="KV blocks (16 tokens) per engine")
    ap.add_argument("--sessions", action="store_true", help="route with session ids")
    ap.add_argument("--shape-seeds", type=_ints, default=[], help="issue-45 shapes, these seeds")
    ap.add_argument("--shape-requests", type=int, default=TRACE_DEFAULTS["rag"].requests)
    ap.add_argument("--config-a", type=_config, default={}, help="first policy's settings")
    ap.add_argument("--config-b", type=_config, default={}, help="second policy's settings")
    args = ap.parse_args(argv)
    policies = args.policies.split(",")
    if len(policies) != 2:
        ap.error("--policies takes two names")
    a, b = policies
    print(
        f"{args.replicas} engines (h200-sparse, {args.blocks} KV blocks each), "
        f"{'with' if args.sessions else 'without'} session ids; TTFT in simulated seconds"
    )
    print(
        f"{'trace':9} {'window':8} {a + ' mean/p99/hit':>26} {b + ' mean/p99/hit':>26} "
        f"{'mean':>6} {'p99':>6} {'hit':>6}"
    )
    ratios: dict[str, list[tuple[float, float, float]]] = {}
    for kind, label, trace, speedup in windows(args):
        fa = run(trace, a, args.config_a, speedup, args)
        fb = run(trace, b, args.config_b, speedup, args)
        r = (fa.mean / fb.mean, fa.p99 / fb.p99, fa.hit / fb.hit if fb.hit else math.nan)
        ratios.setdefault(kind, []).append(r)
        print(
            f"{kind:9} {label:8} {fa.cell():>26} {fb.cell():>26} {r[0]:6.3f} {r[1]:6.3f} {r[2]:6.3f}"
        )
    for kind, rows in ratios.items():
        geo = [math.exp(sum(math.log(row[i]) for row in rows) / len(rows)) for i in range(3)]
        print(
            f"{kind}: {a} over {b}, geometric mean of {len(rows)} windows: "
            f"mean TTFT {geo[0]:.3f}, p99 {geo[1]:.3f}, hit {geo[2]:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
