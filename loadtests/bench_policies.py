"""Replay a real-shaped trace through the gateway once per routing policy.

Reads the Mooncake synthetic trace (`../shared/traces/synthetic_trace.jsonl` next to the
repository; never copied into it), rebuilds prompts from its 512-token block hashes (same
hash, same text: gateway.trace.replay), and replays a window of it open-loop, compressed
by `--speedup`, through a kvgate gateway in front of 8 simulated engines with finite KV
capacity. The engines run in a child process (their step loops would otherwise compete
with the gateway for one event loop); each policy gets fresh engines with cold caches.

Printed per policy: token-weighted prefix-cache hit rate (sum of the engines' reported
`cached_tokens` over prompt tokens), TTFT p50/p99 and end-to-end p99 (in simulated
seconds: wall time x --time-scale), and load imbalance (max/mean prompt tokens per
engine, from each engine's own prompt-token counter). The last line is one engine with the
whole cluster's KV capacity (and 8x its compute) on the same requests.

    python loadtests/bench_policies.py [--start 2993 --requests 1000 --speedup 4 --time-scale 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Runnable from a checkout without installing: the repository root holds gateway/ and plugins/.
sys.path.insert(0, str(ROOT))

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.trace.format import Trace, parse_mooncake
from gateway.trace.replay import replay
from gateway.trace.report import ReplayReport, percentile

TRACE = ROOT.parent / "shared" / "traces" / "synthetic_trace.jsonl"
POLICIES = ("round_robin", "least_load", "consistent_hash", "prefix_affinity")
MODEL = "kvgate-sim"


# -- engine child process ------------------------------------------------------------------


async def _serve_engines(
    replicas: int,
    blocks: int,
    scale: int,
    time_scale: float,
    kv_events: bool = False,
    priority: bool = False,
    prefill_speed: float = 1.0,
) -> None:
    from gateway.sim.cluster import SimCluster
    from gateway.sim.profiles import get_profile
    from gateway.sim.server import KVEventsOptions

    base = get_profile("h200-sparse")
    profile = base.scaled(
        num_gpu_blocks=blocks * scale,
        prefill_tokens_per_s=base.prefill_tokens_per_s * scale * prefill_speed,
        max_num_seqs=base.max_num_seqs * scale,
        max_num_batched_tokens=base.max_num_batched_tokens * scale,
    )
    events = KVEventsOptions() if kv_events else None
    async with SimCluster(
        replicas,
        profile,
        model=MODEL,
        time_scale=time_scale,
        kv_events=events,
        priority_scheduling=priority,
    ) as cluster:
        for engine in cluster.engines:
            # "url [pub-endpoint replay-endpoint]": where each engine publishes its KV events.
            pub = engine.kv_publisher
            extra = f" {pub.endpoint} {pub.replay_endpoint}" if pub is not None else ""
            print(engine.url + extra, flush=True)
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


@dataclass
class Engines:
    proc: subprocess.Popen[str]
    urls: list[str]
    # Per engine (PUB endpoint, replay endpoint) of its KV events, when it publishes them.
    kv: list[tuple[str, str]] = field(default_factory=list)

    def stop(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_engines(
    replicas: int,
    blocks: int,
    time_scale: float,
    scale: int = 1,
    kv_events: bool = False,
    priority: bool = False,
    prefill_speed: float = 1.0,
) -> Engines:
    """`replicas` simulated engines in a child process; `priority`: they run vLLM's
    priority scheduling (requests that send no `priority` are served first come);
    `prefill_speed`: their prefill tokens/s times this (0.5: prefill half as fast, decode
    unchanged)."""
    cmd = [
        sys.executable,
        __file__,
        "--engines-child",
        str(replicas),
        "--blocks",
        str(blocks),
        "--scale",
        str(scale),
        "--time-scale",
        str(time_scale),
    ]
    if prefill_speed != 1.0:
        cmd += ["--prefill-speed", str(prefill_speed)]
    if kv_events:
        cmd.append("--kv-events")
    if priority:
        cmd.append("--priority-scheduling")
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    urls: list[str] = []
    kv: list[tuple[str, str]] = []
    for line in proc.stdout:
        if line.strip() == "ready":
            return Engines(proc, urls, kv)
        url, *endpoints = line.split()
        urls.append(url)
        if len(endpoints) == 2:
            kv.append((endpoints[0], endpoints[1]))
    raise RuntimeError("engine process exited before it was ready")


async def engine_counters(urls: list[str]) -> list[tuple[float, float, float]]:
    """(prompt tokens, prefix-cache hits, prefix-cache queries) per engine."""
    out = []
    async with httpx.AsyncClient(timeout=10) as http:
        for url in urls:
            text = (await http.get(url + "/metrics")).text
            values: dict[str, float] = {}
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    values[s.name] = values.get(s.name, 0.0) + s.value
            out.append(
                (
                    values.get("vllm:prompt_tokens_total", 0.0),
                    values.get("vllm:prefix_cache_hits_total", 0.0),
                    values.get("vllm:prefix_cache_queries_total", 0.0),
                )
            )
    return out


def routing_decisions(registry: object) -> dict[str, float]:
    """Routing decisions by reason, from the gateway's own metrics."""
    from prometheus_client import generate_latest

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):  # type: ignore[arg-type]
        for s in fam.samples:
            if s.name == "kvgate_routing_decisions_total":
                out[s.labels["reason"]] = out.get(s.labels["reason"], 0.0) + s.value
    return out


# -- one run -------------------------------------------------------------------------------


@dataclass
class Row:
    label: str
    report: ReplayReport
    engine_prompt: list[float]
    engine_hit: float
    time_scale: float
    decisions: dict[str, float] | None = None

    def cells(self) -> str:
        r, k = self.report, self.time_scale
        ok = [x for x in r.results if x.error is None]
        e2e = [(x.end_s - x.start_s) * k for x in ok]
        mean = sum(self.engine_prompt) / len(self.engine_prompt)
        imbalance = max(self.engine_prompt) / mean if mean else float("nan")
        hit = r.hit_rate if r.hit_rate is not None else float("nan")
        return (
            f"{self.label:18} {hit:>7.1%} {self.engine_hit:>7.1%} "
            f"{r.ttft_s.p50 * k:>9.2f} {r.ttft_s.p99 * k:>9.2f} "
            f"{percentile(e2e, 99) if e2e else float('nan'):>9.2f} "
            f"{imbalance:>9.2f} {r.errors:>6}"
        )


def gateway_settings(
    policy: str, urls: list[str], time_scale: float, policy_config: dict[str, object]
) -> object:
    from gateway.settings import load_settings

    return load_settings(
        replicas=[{"id": f"e{i}", "url": u, "models": [MODEL]} for i, u in enumerate(urls)],
        routing={"policy": policy, "policies": {policy: policy_config}},
        # 128-token hash blocks over up to 128K tokens: the whole prompt is hashed.
        session={"block_tokens": 128, "max_prefix_blocks": 1024},
        # Engines run time_scale x faster; scrape as often in simulated time as by default.
        scrape={"interval_s": max(0.02, 0.25 / time_scale), "stale_after_s": 2.0},
        models={"discover": False},
        timeouts={"response_headers_s": 600.0},
    )


async def run_policy(policy: str, trace: Trace, args: argparse.Namespace) -> Row:
    from gateway.app import build_app
    from gateway.serving import start_server

    engines = start_engines(8, args.blocks, args.time_scale)
    try:
        config = json.loads(args.config).get(policy, {})
        app = build_app(gateway_settings(policy, engines.urls, args.time_scale, config))  # type: ignore[arg-type]
        server = await start_server(app)
        try:
            report = await replay(
                trace,
                server.url,
                speedup=args.speedup,
                model=MODEL,
                progress=sys.stderr if args.progress else None,
            )
            decisions = routing_decisions(app.state.gateway.metrics.registry)
        finally:
            await server.stop()
        counters = await engine_counters(engines.urls)
    finally:
        engines.stop()
    hits = sum(c[1] for c in counters)
    queries = sum(c[2] for c in counters)
    return Row(
        policy,
        report,
        [c[0] for c in counters],
        hits / queries if queries else 0.0,
        args.time_scale,
        decisions,
    )


async def run_single(trace: Trace, args: argparse.Namespace) -> Row:
    engines = start_engines(1, args.blocks, args.time_scale, scale=8)
    try:
        report = await replay(trace, engines.urls[0], speedup=args.speedup, model=MODEL)
        counters = await engine_counters(engines.urls)
    finally:
        engines.stop()
    _, hits, queries = counters[0]
    return Row(
        "one 8x engine",
        report,
        [counters[0][0]],
        hits / queries if queries else 0.0,
        args.time_scale,
    )


async def main_async(args: argparse.Namespace) -> None:
    path = Path(args.trace)
    if not path.exists():
        sys.exit(f"trace not found: {path} (expected ../shared/traces/ next to the repo)")
    trace = parse_mooncake(path.read_bytes().splitlines(), path.name).window(
        args.start, args.requests
    )
    print(
        f"trace window: {len(trace.records)} requests from #{args.start}, "
        f"{trace.records[-1].arrival_s:.0f} s of arrivals, speedup {args.speedup}, "
        f"engine time scale {args.time_scale}, KV {args.blocks * 16} tokens per engine",
        flush=True,
    )
    rows = []
    for policy in args.policies:
        rows.append(await run_policy(policy, trace, args))
        print(f"  done: {policy}", file=sys.stderr, flush=True)
    rows.append(await run_single(trace, args))
    print(
        f"{'policy':18} {'hit':>7} {'eng hit':>7} {'ttft p50':>9} {'ttft p99':>9} "
        f"{'e2e p99':>9} {'imbalance':>9} {'errors':>6}"
    )
    for row in rows:
        print(row.cells())
    for row in rows:
        extra = []
        if row.decisions:
            extra.append(
                "decisions " + ", ".join(f"{k}={int(v)}" for k, v in sorted(row.decisions.items()))
            )
        if row.report.error_kinds:
            extra.append(f"errors {dict(row.report.error_kinds)}")
        if extra:
            print(f"  {row.label}: " + "; ".join(extra))
    single = rows[-1].report.hit_rate or 0.0
    best = {r.label: r for r in rows[:-1]}
    if "prefix_affinity" in best and single:
        pa = best["prefix_affinity"].report.hit_rate or 0.0
        print(f"prefix_affinity hit rate / one big engine: {pa / single:.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    # The trace's last 1000 requests: its conversations are under way, so prefixes recur.
    ap.add_argument("--start", type=int, default=2993, help="first request of the window")
    ap.add_argument("--requests", type=int, default=1000, help="requests in the window")
    ap.add_argument("--speedup", type=float, default=4.0, help="arrival compression")
    ap.add_argument("--time-scale", type=float, default=4.0, help="engine speed-up")
    ap.add_argument("--blocks", type=int, default=40000, help="KV blocks (16 tokens) per engine")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--progress", action="store_true")
    ap.add_argument(
        "--config",
        default="{}",
        help='policy configs as JSON, e.g. \'{"prefix_affinity": {"load_weight": 0.5}}\'',
    )
    ap.add_argument("--engines-child", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--scale", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--kv-events", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--priority-scheduling", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prefill-speed", type=float, default=1.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engines_child:
        asyncio.run(
            _serve_engines(
                args.engines_child,
                args.blocks,
                args.scale,
                args.time_scale,
                args.kv_events,
                args.priority_scheduling,
                args.prefill_speed,
            )
        )
        return
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
