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

    python loadtests/bench_admission.py [--duration 20] [--overload 1.5] [--time-scale 0.5]

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
            ok = [r.ttft for r in rows if r.status == 200 and r.ttft is not None]
            n429 = sum(r.status == 429 for r in rows)
            lost = len(rows) - len(ok) - n429
            stats = {
                "n": len(rows),
                "ok": len(ok),
                "429": n429,
                "lost": lost,
                "p50": _pct(ok, 0.5),
                "p99": _pct(ok, 0.99),
                "mean": statistics.fmean(ok) if ok else float("nan"),
                "max": max(ok) if ok else float("nan"),
            }
            table[(cls, size)] = stats
            rate = 100 * len(ok) / len(rows) if rows else float("nan")
            print(
                f"{cls:<12}{size:<7}{len(rows):>5}{rate:>6.0f}%{n429:>5}{lost:>5}"
                f"{stats['p50']:>10.3f}{stats['p99']:>10.3f}{stats['mean']:>10.3f}"
            )
    errors = {r.error for r in run.results if r.error}
    if errors:
        print("client errors:", ", ".join(sorted(errors)))
    return table


def _admission(
    enabled: bool, slots: int, max_wait_s: float, prompt_budget: float = 2.0
) -> dict[str, Any]:
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
        },
        "max_wait_s": max_wait_s,
        "class_head_start_s": 3.0,
        "size_head_start_s": 6.0,
        "work_cap_tokens": 8192,
        "max_queue": 4096,
    }


async def one_run(
    name: str, args: argparse.Namespace, rate: float, admission: dict[str, Any]
) -> Run | float:
    """One load run (`rate` > 0), or a capacity measurement (`rate` == 0)."""
    duration = args.unloaded_duration if name.startswith("unloaded") else args.duration
    profile = PROFILES[args.profile].scaled(
        max_num_seqs=args.slots, max_num_batched_tokens=args.batch_tokens
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
        run = await drive(server.url, rate, duration, Mix(), args.seed)
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
) -> None:
    print("\n== targets")
    for size in ("short", "long"):
        ref, got = unloaded[(HIGH, size)]["p99"], on[(HIGH, size)]["p99"]
        verdict = "met" if got <= 2 * ref else "MISSED"
        print(
            f"high class {size:<5} TTFT p99: {got:.3f}s under overload vs {ref:.3f}s unloaded"
            f" (x{got / ref:.2f}, target <= x2): {verdict}"
        )

    def short_mean(table: dict[tuple[str, str], dict[str, float]]) -> float:
        pairs = [(table[(c, "short")]["mean"], table[(c, "short")]["ok"]) for c in (HIGH, LOW)]
        total = sum(n for _, n in pairs)
        return sum(m * n for m, n in pairs if n) / total if total else float("nan")

    s_off, s_on = short_mean(off), short_mean(on)
    gain = 1 - s_on / s_off
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
    print(
        f"low class: {completed} completed, {rejected} answered 429, {lost} lost; "
        f"gateway queue: {within:.0f} of {released:.0f} released within the "
        f"{max_wait_s:g}s wait bound: {'met' if ok else 'MISSED'}"
    )


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
        default=40.0,
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
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(
        f"mix: {Mix()}; engine: {args.profile}, max_num_seqs={args.slots}, "
        f"max_num_batched_tokens={args.batch_tokens}, time_scale={args.time_scale}, "
        f"replicas={args.replicas}"
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
    t_unloaded = report(unloaded)
    off = await one_run("overload, admission off (engine FCFS)", args, rate, off_cfg)
    assert isinstance(off, Run)
    t_off = report(off)
    on = await one_run(
        "overload, admission on",
        args,
        rate,
        _admission(True, args.slots, args.max_wait, args.prompt_budget),
    )
    assert isinstance(on, Run)
    t_on = report(on)
    check(t_unloaded, t_off, t_on, on, args.max_wait)


if __name__ == "__main__":
    asyncio.run(main())
