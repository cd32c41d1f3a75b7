"""Admission control under overload: priority classes and shortest-remaining-first.

Drives a gateway in front of simulated engines (real uvicorn servers on loopback) with an
open-loop Poisson mix -- a few long prompts, many short ones, two classes -- past
saturation, and prints per class and size: TTFT p50/p99, completion rate and 429s. Runs:

  unloaded   the same mix at a fraction of the rate, admission off (the reference TTFT)
  off        overload, admission off: engines queue first come, first served
  on         overload, admission on: the gateway holds requests while the replica is
             saturated and releases them by class, then shortest predicted work, with aging

Targets checked at the end: the high class's TTFT p99 under overload within 2x its
unloaded value; short requests' mean TTFT at least 30% lower than with admission off;
every low-class request either completes (TTFT within the wait bound plus its unloaded p99)
or gets a 429, none lost.

    python loadtests/bench_admission.py [--runs 3] [--duration 20] [--overload 1.5]

Statistics: the overload pair (off, on) runs `--runs` times with different seeds; each run's
targets are printed, then all runs' samples pooled, then the spread of each figure. The
unloaded reference pools both classes per size (admission off never reads the class). The
engines use `long_prefill_token_threshold` (vLLM's per-request prefill chunk cap).

The arrival rates are multiples of a capacity measured first (closed loop, admission off),
so the overload is real on a fast or a contended machine alike.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.admission.config import AdmissionSettings
from gateway.admission.gate import AdmissionGate
from gateway.app import build_app
from gateway.cluster import Cluster
from gateway.scrape.config import ScrapeSettings
from gateway.scrape.scraper import MetricsScraper
from gateway.serving import start_server
from gateway.settings import load_settings
from gateway.sim.profiles import PROFILES
from gateway.sim.server import SimEngine
from gateway.types import EngineLoad, ReplicaId, ReplicaState, RouteRequest, SessionKey

MODEL = "kvgate-sim"
HIGH, LOW = "interactive", "batch"
_TOKEN = re.compile(rb'"content":\s*"[^"]')
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
]


@dataclass
class Mix:
    """Prefill-bound, as agent traffic is: a few long prompts carry most of the tokens."""

    long_share: float = 0.1
    long_tokens: int = 12000
    short_tokens: int = 300
    high_share: float = 0.25
    max_tokens: int = 8


@dataclass
class Result:
    cls: str
    size: str
    status: int = 0
    ttft: float | None = None
    error: str = ""


@dataclass
class Run:
    name: str
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0
    # The gateway's own admission histogram: class -> (released, released within max_wait_s)
    released_within: dict[str, tuple[float, float]] = field(default_factory=dict)


def _prompt(rng: random.Random, tokens: int) -> str:
    # ~4 characters per token; a random head keeps prompts from sharing cached prefixes.
    head = f"{rng.getrandbits(64):016x} "
    body = " ".join(rng.choice(WORDS) for _ in range(tokens * 4 // 6))
    return (head + body)[: tokens * 4]


async def _one(http: httpx.AsyncClient, res: Result, body: dict[str, Any]) -> None:
    t0 = time.perf_counter()
    headers = {"X-Priority": res.cls}
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            res.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                return
            async for chunk in r.aiter_bytes():
                # The first event carries only the role (empty content), as vLLM's does.
                if res.ttft is None and _TOKEN.search(chunk):
                    res.ttft = time.perf_counter() - t0
    except httpx.HTTPError as exc:
        res.error = type(exc).__name__


def _body(rng: random.Random, mix: Mix) -> tuple[str, str, dict[str, Any]]:
    size = "long" if rng.random() < mix.long_share else "short"
    cls = HIGH if rng.random() < mix.high_share else LOW
    tokens = mix.long_tokens if size == "long" else mix.short_tokens
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": _prompt(rng, tokens)}],
        "max_tokens": mix.max_tokens,
        "stream": True,
    }
    return cls, size, body


async def calibrate(url: str, workers: int, duration: float, mix: Mix, seed: int) -> float:
    """Completions per second with `workers` clients in a closed loop: the capacity."""
    rng = random.Random(seed + 1000)
    done = 0
    t0 = time.perf_counter()

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal done
        while time.perf_counter() - t0 < duration:
            cls, size, body = _body(rng, mix)
            res = Result(cls, size)
            await _one(http, res, body)
            if res.status == 200:
                done += 1

    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        await asyncio.gather(*(worker(http) for _ in range(workers)))
    return done / (time.perf_counter() - t0)


async def drive(url: str, rate: float, duration: float, mix: Mix, seed: int) -> Run:
    rng = random.Random(seed)
    run = Run(name="")
    tasks: list[asyncio.Task[None]] = []
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        t0 = time.perf_counter()
        next_at = t0
        while next_at - t0 < duration:
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            cls, size, body = _body(rng, mix)
            res = Result(cls, size)
            run.results.append(res)
            tasks.append(asyncio.create_task(_one(http, res, body)))
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        run.wall_s = time.perf_counter() - t0
    return run


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _stats(rows: list[Result]) -> dict[str, float]:
    ok = [r.ttft for r in rows if r.status == 200 and r.ttft is not None]
    n429 = sum(r.status == 429 for r in rows)
    return {
        "n": len(rows),
        "ok": len(ok),
        "429": n429,
        "lost": len(rows) - len(ok) - n429,
        "p50": _pct(ok, 0.5),
        "p99": _pct(ok, 0.99),
        "mean": statistics.fmean(ok) if ok else float("nan"),
        "max": max(ok) if ok else float("nan"),
    }


def _print_row(cls: str, size: str, stats: dict[str, float]) -> None:
    rate = 100 * stats["ok"] / stats["n"] if stats["n"] else float("nan")
    print(
        f"{cls:<12}{size:<7}{stats['n']:>5.0f}{rate:>6.0f}%{stats['429']:>5.0f}"
        f"{stats['lost']:>5.0f}{stats['p50']:>10.3f}{stats['p99']:>10.3f}{stats['mean']:>10.3f}"
    )


def report(run: Run) -> dict[tuple[str, str], dict[str, float]]:
    print(f"\n== {run.name}: {len(run.results)} requests in {run.wall_s:.1f}s")
    print(
        f"{'class':<12}{'size':<7}{'n':>5}{'ok%':>7}{'429':>5}{'lost':>5}"
        f"{'ttft p50':>10}{'ttft p99':>10}{'ttft mean':>10}"
    )
    table: dict[tuple[str, str], dict[str, float]] = {}
    for cls in (HIGH, LOW):
        for size in ("short", "long"):
            rows = [r for r in run.results if r.cls == cls and r.size == size]
            table[(cls, size)] = stats = _stats(rows)
            _print_row(cls, size, stats)
    errors = {r.error for r in run.results if r.error}
    if errors:
        print("client errors:", ", ".join(sorted(errors)))
    return table


def _admission(
    enabled: bool,
    slots: int,
    max_wait_s: float,
    prompt_budget: float = 2.0,
    backfill_s: float = 0.0,
    prefill_budget: int = 0,
    prefill_chunk: int = 0,
) -> dict[str, Any]:
    saturation: dict[str, Any] = {}
    if prefill_budget:
        # Tokens per engine step of requests still prefilling; batch's holdback leaves
        # the rest of each step to the interactive class.
        saturation["max_prefill_tokens"] = prefill_budget
        saturation["prefill_chunk_tokens"] = prefill_chunk or None
    return {
        "enabled": enabled,
        "classes": [
            {"name": HIGH},
            {"name": "default", "holdback": 0.1},
            {"name": LOW, "holdback": 0.25},
        ],
        "saturation": {
            "max_inflight": slots,
            "max_waiting": 2,
            "max_kv_usage": 0.9,
            # Keeps long prefills from sharing the engine's step budget: at the default 2x,
            # batch (held back by a quarter) runs one long prefill at a time.
            "max_prompt_tokens": int(prompt_budget * Mix().long_tokens),
            **saturation,
        },
        "max_wait_s": max_wait_s,
        "class_head_start_s": 3.0,
        "size_head_start_s": 6.0,
        # A long prompt waiting for the prompt-token budget lets its class's short ones by
        # for this long, then blocks them (well within the aging bound).
        "backfill_s": backfill_s,
        "work_cap_tokens": 8192,
        "max_queue": 4096,
    }


async def one_run(
    name: str, args: argparse.Namespace, rate: float, admission: dict[str, Any], seed: int = 0
) -> Run | float:
    """One load run (`rate` > 0), or a capacity measurement (`rate` == 0)."""
    duration = args.unloaded_duration if name.startswith("unloaded") else args.duration
    profile = PROFILES[args.profile].scaled(
        max_num_seqs=args.slots,
        max_num_batched_tokens=args.batch_tokens,
        long_prefill_token_threshold=args.long_prefill_threshold,
    )
    engines = [
        SimEngine(profile, index=i, seed=i, time_scale=args.time_scale)
        for i in range(args.replicas)
    ]
    for e in engines:
        await e.start()
    settings = load_settings(
        replicas=[{"id": f"e{e.index}", "url": e.url, "models": [MODEL]} for e in engines],
        routing={"policy": "consistent_hash"},
        admission=admission,
        server={"log_level": "warning"},
    )
    app = build_app(settings)
    state = app.state.gateway
    if not any(isinstance(s, MetricsScraper) for s in state.services):
        state.services.append(
            MetricsScraper(
                ScrapeSettings(interval_s=0.05, stale_after_s=1.0),
                lambda: state.cluster.view().replicas,
                on_load=state.cluster.publish_load,
            )
        )
    server = await start_server(app)
    try:
        if rate == 0:
            return await calibrate(server.url, args.slots, args.calibrate, Mix(), args.seed)
        run = await drive(server.url, rate, duration, Mix(), seed or args.seed)
        run.name = name
        if admission["enabled"]:
            async with httpx.AsyncClient(base_url=server.url) as http:
                text = (await http.get("/metrics")).text
            run.released_within = _released_within(text, admission["max_wait_s"])
        return run
    finally:
        await server.stop()
        for e in engines:
            await e.stop()


def _released_within(text: str, bound: float) -> dict[str, tuple[float, float]]:
    """Per class: requests released from the queue, and those released within `bound`."""
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "kvgate_admission_wait_seconds":
            continue
        for sample in family.samples:
            labels = sample.labels
            if labels.get("outcome") != "released" or not sample.name.endswith("_bucket"):
                continue
            # [released, released within the first bucket edge >= bound, that edge]
            entry = out.setdefault(labels["priority_class"], [0.0, 0.0, float("inf")])
            le = float(labels["le"])
            if le == float("inf"):
                entry[0] = sample.value
            elif bound <= le < entry[2]:
                entry[1], entry[2] = sample.value, le
    return {k: (v[0], v[1]) for k, v in out.items()}


def check(
    unloaded: dict[tuple[str, str], dict[str, float]],
    off: dict[tuple[str, str], dict[str, float]],
    on: dict[tuple[str, str], dict[str, float]],
    on_run: Run,
    max_wait_s: float,
    title: str = "targets",
) -> dict[str, float]:
    print(f"\n== {title}")
    figures: dict[str, float] = {}
    for size in ("short", "long"):
        ref, got = unloaded[(HIGH, size)]["p99"], on[(HIGH, size)]["p99"]
        figures[f"high {size} p99 x"] = got / ref
        verdict = "met" if got <= 2 * ref else "MISSED"
        print(
            f"high {size:<5} TTFT p99: {got:.3f}s overloaded (n={on[(HIGH, size)]['ok']:.0f})"
            f" vs {ref:.3f}s unloaded (n={unloaded[(HIGH, size)]['ok']:.0f})"
            f" (x{got / ref:.2f}, target <= x2): {verdict}"
        )

    def short_mean(table: dict[tuple[str, str], dict[str, float]]) -> float:
        pairs = [(table[(c, "short")]["mean"], table[(c, "short")]["ok"]) for c in (HIGH, LOW)]
        total = sum(n for _, n in pairs)
        return sum(m * n for m, n in pairs if n) / total if total else float("nan")

    s_off, s_on = short_mean(off), short_mean(on)
    gain = 1 - s_on / s_off
    figures["short mean gain %"] = 100 * gain
    print(
        f"short requests' mean TTFT: {s_on:.3f}s on vs {s_off:.3f}s off "
        f"({100 * gain:.0f}% lower, target >= 30%): {'met' if gain >= 0.3 else 'MISSED'}"
    )
    lost = completed = rejected = 0
    for r in on_run.results:
        if r.cls != LOW:
            continue
        if r.status == 200 and r.ttft is not None:
            completed += 1
        elif r.status == 429:
            rejected += 1
        else:
            lost += 1
    released, within = on_run.released_within.get(LOW, (0.0, 0.0))
    ok = lost == 0 and released == within
    figures["low lost"] = lost
    figures["low released late"] = released - within
    print(
        f"low class: {completed} completed, {rejected} answered 429, {lost} lost; "
        f"gateway queue: {within:.0f} of {released:.0f} released within the "
        f"{max_wait_s:g}s wait bound: {'met' if ok else 'MISSED'}"
    )
    return figures


def class_blind(run: Run) -> dict[tuple[str, str], dict[str, float]]:
    """The unloaded reference per size, both classes pooled.

    With admission off nothing reads the class (no queue, no engine `priority`), so both
    classes' requests of one size are samples of the same distribution; pooling them gives
    the long cell a usable sample count.
    """
    table: dict[tuple[str, str], dict[str, float]] = {}
    for size in ("short", "long"):
        stats = _stats([r for r in run.results if r.size == size])
        _print_row("(both)", size, stats)
        for cls in (HIGH, LOW):
            table[(cls, size)] = stats
    return table


def merged(name: str, runs: list[Run]) -> Run:
    """All runs' requests as one run: pooled samples for the percentiles."""
    out = Run(name=name, wall_s=sum(r.wall_s for r in runs))
    for r in runs:
        out.results.extend(r.results)
        for cls, (released, within) in r.released_within.items():
            a, b = out.released_within.get(cls, (0.0, 0.0))
            out.released_within[cls] = (a + released, b + within)
    return out


def spread(per_run: list[dict[str, float]]) -> None:
    print(f"\n== spread over {len(per_run)} runs (min / median / max)")
    for key in per_run[0]:
        values = sorted(f[key] for f in per_run)
        print(f"{key:<22}{values[0]:>8.2f}{statistics.median(values):>8.2f}{values[-1]:>8.2f}")


def fast_path_cost(calls: int = 200_000) -> float:
    """Nanoseconds per `must_wait` on a replica with room: what admission adds at low load."""
    cluster = Cluster(
        [ReplicaState(id=ReplicaId("r0"), url="http://r0", models=frozenset({MODEL}))]
    )
    cluster.set_healthy(ReplicaId("r0"), True)
    cluster.publish_load(
        ReplicaId("r0"), EngineLoad(waiting=0, running=3, kv_usage=0.3, scraped_at=cluster.clock())
    )
    gate = AdmissionGate(AdmissionSettings(enabled=True), cluster.view)
    request = RouteRequest(request_id="x", model=MODEL, session_key=SessionKey("s"))
    view = cluster.view()
    must_wait = gate.must_wait
    replica = ReplicaId("r0")
    assert not must_wait(request, replica, view)
    t0 = time.perf_counter()
    for _ in range(calls):
        must_wait(request, replica, view)
    return (time.perf_counter() - t0) / calls * 1e9


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of overload")
    parser.add_argument(
        "--unloaded-duration",
        type=float,
        default=60.0,
        help="seconds of the light-load reference run (more samples)",
    )
    parser.add_argument(
        "--overload",
        type=float,
        default=1.5,
        help="arrival rate as a multiple of the measured capacity",
    )
    parser.add_argument(
        "--unloaded",
        type=float,
        default=0.25,
        help="reference run's rate as a multiple of the measured capacity",
    )
    parser.add_argument(
        "--calibrate",
        type=float,
        default=8.0,
        help="seconds of closed-loop load that measure the capacity",
    )
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--slots", type=int, default=16, help="engine max_num_seqs")
    parser.add_argument(
        "--batch-tokens",
        type=int,
        default=2048,
        help="engine max_num_batched_tokens (chunked-prefill budget)",
    )
    parser.add_argument("--profile", default="h200-sparse", choices=sorted(PROFILES))
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="multiplier on simulated engine durations"
    )
    parser.add_argument("--max-wait", type=float, default=10.0, help="admission max_wait_s")
    parser.add_argument(
        "--prompt-budget",
        type=float,
        default=2.0,
        help="max_prompt_tokens as a multiple of the long prompt",
    )
    parser.add_argument("--backfill", type=float, default=3.0, help="admission backfill_s")
    parser.add_argument(
        "--prefill-budget",
        type=float,
        default=0.0,
        help="max_prefill_tokens as a multiple of --batch-tokens (0: off)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--runs", type=int, default=3, help="overload off/on pairs, each with its own seed"
    )
    parser.add_argument(
        "--long-prefill-threshold",
        type=int,
        default=1024,
        help="engine long_prefill_token_threshold (0: a long prefill may take the whole step)",
    )
    args = parser.parse_args()
    print(
        f"mix: {Mix()}; engine: {args.profile}, max_num_seqs={args.slots}, "
        f"max_num_batched_tokens={args.batch_tokens}, "
        f"long_prefill_token_threshold={args.long_prefill_threshold}, "
        f"time_scale={args.time_scale}, replicas={args.replicas}"
    )
    print(f"admission fast path (replica not saturated): {fast_path_cost():.0f} ns per request")
    off_cfg = _admission(False, args.slots, args.max_wait)
    capacity = await one_run("capacity", args, 0, off_cfg)
    assert isinstance(capacity, float)
    rate = capacity * args.overload
    print(
        f"measured capacity {capacity:.2f} req/s (closed loop, {args.slots} clients); "
        f"overload {rate:.2f} req/s for {args.duration:g}s, "
        f"unloaded reference {capacity * args.unloaded:.2f} req/s for "
        f"{args.unloaded_duration:g}s"
    )
    unloaded = await one_run(
        "unloaded (light load, admission off)", args, capacity * args.unloaded, off_cfg
    )
    assert isinstance(unloaded, Run)
    report(unloaded)
    t_unloaded = class_blind(unloaded)
    on_cfg = _admission(
        True,
        args.slots,
        args.max_wait,
        args.prompt_budget,
        args.backfill,
        int(args.prefill_budget * args.batch_tokens),
        args.long_prefill_threshold,
    )
    offs: list[Run] = []
    ons: list[Run] = []
    per_run: list[dict[str, float]] = []
    for i in range(args.runs):
        seed = args.seed + 100 * (i + 1)
        off = await one_run(
            f"run {i + 1}/{args.runs}: overload, admission off (engine FCFS)",
            args,
            rate,
            off_cfg,
            seed,
        )
        assert isinstance(off, Run)
        t_off = report(off)
        on = await one_run(
            f"run {i + 1}/{args.runs}: overload, admission on", args, rate, on_cfg, seed
        )
        assert isinstance(on, Run)
        t_on = report(on)
        per_run.append(check(t_unloaded, t_off, t_on, on, args.max_wait, f"targets, run {i + 1}"))
        offs.append(off)
        ons.append(on)
    if args.runs > 1:
        pooled_off = report(merged(f"all {args.runs} runs pooled: admission off", offs))
        pooled_on_run = merged(f"all {args.runs} runs pooled: admission on", ons)
        pooled_on = report(pooled_on_run)
        check(t_unloaded, pooled_off, pooled_on, pooled_on_run, args.max_wait, "targets, pooled")
        spread(per_run)


if __name__ == "__main__":
    asyncio.run(main())
