"""Does `kvgate plan --trace` predict what a live deployment does?

    python loadtests/bench_plan.py [--model llama-3.1-8b] [--card h100] [--ttft 0.3]

Generates a small agent trace, lets the planner pick the replica count for the TTFT target
(simulated engines sized by the card's memory budget, `kvgate simulate` underneath), then
replays the same trace through a `kvgate serve` process (lineage routing, loopback HTTP) in
front of that many HTTP simulated engines with the same profile (a third process), and
compares hit rate and TTFT. Tolerances: hit rate within 10 points, TTFT p50 and p90
within 50% or 100 ms (the live path adds HTTP, scrape lag and event-loop jitter).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_overhead import wait_ready  # this folder is on sys.path when run as a script

from gateway.plan.cards import get_card
from gateway.plan.fromtrace import Pool, SimSettings, plan_pool
from gateway.plan.hfconfig import resolve_model
from gateway.plan.memory import EngineSettings, budget
from gateway.plan.perf import sim_profile
from gateway.sim.cluster import SimCluster
from gateway.sim.profiles import HardwareProfile
from gateway.trace.format import Trace
from gateway.trace.generate import AgentTraceOptions, generate_agent_trace
from gateway.trace.replay import replay
from gateway.trace.report import ReplayReport

ROOT = Path(__file__).resolve().parents[1]
HIT_POINTS = 0.10
TTFT_SHARE = 0.5
TTFT_FLOOR_S = 0.1


def within(predicted: float, live: float) -> bool:
    return abs(predicted - live) <= max(TTFT_SHARE * live, TTFT_FLOOR_S)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_base(count: int) -> int:
    """A port with the `count - 1` after it free too (the engines use consecutive ports)."""
    for _ in range(100):
        base = free_port()
        try:
            for offset in range(1, count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", base + offset))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports")


def spawn(args: list[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def serve_engines(profile: HardwareProfile, replicas: int, port: int) -> None:
    """The child process: `replicas` HTTP engines on consecutive ports, until SIGINT."""
    done = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGINT, done.set)
    async with SimCluster(replicas, profile, base_port=port):
        await done.wait()


def live(trace: Trace, profile: HardwareProfile, replicas: int, speedup: float) -> ReplayReport:
    """Engines, gateway and load generator in three processes, as in a deployment."""
    port = free_base(replicas)
    spec = json.dumps(dataclasses.asdict(profile))
    engines = spawn(
        [
            sys.executable,
            __file__,
            "--serve-engines",
            spec,
            "--replicas",
            str(replicas),
            "--port",
            str(port),
        ]
    )
    gateway = None
    try:
        urls = [f"http://127.0.0.1:{port + i}" for i in range(replicas)]
        for url in urls:
            wait_ready(url + "/health")
        gw_port = free_port()
        cfg = Path(tempfile.mkdtemp()) / "plan-bench.yaml"
        cfg.write_text(
            f"server:\n  port: {gw_port}\n  log_level: warning\nreplicas:\n"
            + "".join(f"  - url: {u}\n" for u in urls)
            + "scrape:\n  interval_s: 0.25\n  stale_after_s: 2.0\n"
        )
        gateway = spawn([sys.executable, "-m", "gateway.cli", "serve", "-c", str(cfg)])
        base = f"http://127.0.0.1:{gw_port}"
        wait_ready(base + "/ready")
        time.sleep(1.0)  # a few scrapes, so routing sees every replica's load
        return asyncio.run(replay(trace, base, speedup=speedup))
    finally:
        if gateway is not None:
            stop(gateway)
        stop(engines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--card", default="h100")
    parser.add_argument("--ttft", type=float, default=0.3, help="target TTFT p90, seconds")
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--context-scale", type=float, default=0.2)
    parser.add_argument("--speedup", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--serve-engines", help=argparse.SUPPRESS)
    parser.add_argument("--replicas", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_engines:
        fields = json.loads(args.serve_engines)
        fields["natural_output_tokens"] = tuple(fields["natural_output_tokens"])
        asyncio.run(serve_engines(HardwareProfile(**fields), args.replicas, args.port))
        return 0

    trace = generate_agent_trace(
        AgentTraceOptions(
            seed=args.seed,
            sessions=args.sessions,
            duration_s=args.duration,
            context_scale=args.context_scale,
            think_s=3.0,
        )
    )
    settings = EngineSettings(max_model_len=65536)
    b = budget(resolve_model(args.model), get_card(args.card), settings)
    plan = plan_pool(
        trace,
        Pool(args.card, b, None),
        args.ttft,
        sim=SimSettings(speedup=args.speedup, max_replicas=16),
    )
    if plan.needed is None:
        tried = ", ".join(f"{q.replicas}: {q.ttft_s:.2f} s" for q in plan.points)
        print(f"planner: target not met with up to 16 replicas (TTFT p90 {tried})")
        return 1
    p = plan.needed
    context = max(
        1,
        sum(r.input_tokens + r.output_tokens for r in trace.records) // max(1, len(trace.records)),
    )
    profile = sim_profile(b, name=f"{args.card}-planned", context=context)
    print(
        f"trace: {len(trace.records)} requests of {args.sessions} sessions, speedup"
        f" {args.speedup:g}; planner: {p.replicas} x {args.card} for TTFT p90 <="
        f" {args.ttft:g} s"
    )
    rep = live(trace, profile, p.replicas, args.speedup)
    rows: list[tuple[str, float | None, float | None, str]] = [
        ("hit rate", p.hit_rate, rep.hit_rate, "{:.1%}"),
        ("TTFT p50 s", p.ttft_p50_s, rep.ttft_s.p50, "{:.3f}"),
        ("TTFT p90 s", p.ttft_s, rep.ttft_s.p90, "{:.3f}"),
        ("total tok/s", p.total_tokens_per_s, rep.total_tokens_per_s, "{:,.0f}"),
        ("errors", p.errors, rep.errors, "{:.0f}"),
    ]
    ok = True
    print(f"{'':14} {'planned':>10} {'live':>10}  verdict")
    for name, planned, measured, fmt in rows:
        verdict = ""
        if planned is None or measured is None or math.isnan(measured):
            verdict = "n/a"
        elif name == "hit rate":
            verdict = "PASS" if abs(planned - measured) <= HIT_POINTS else "FAIL"
        elif name.startswith("TTFT"):
            verdict = "PASS" if within(planned, measured) else "FAIL"
        ok = ok and verdict != "FAIL"
        shown = [fmt.format(v) if v is not None else "-" for v in (planned, measured)]
        print(f"{name:14} {shown[0]:>10} {shown[1]:>10}  {verdict}")
    print(
        f"tolerance: hit rate +-{HIT_POINTS:.0%} points; TTFT +-{TTFT_SHARE:.0%} or"
        f" {TTFT_FLOOR_S * 1000:.0f} ms; overall {'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
