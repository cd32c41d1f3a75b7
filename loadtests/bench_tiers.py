"""Tiered models against sending everything to the large model, on simulated engines.

Two simulated models behind a real gateway: `small-7b` (a faster profile: prefill 3x and
decode steps 1/3 of the large one's) and `large-70b` (`h200-sparse`). Prices are
assumptions of this benchmark (`--small-price`, `--large-price`, per million total
tokens), not measurements. The small engine fails a known share of hard requests: a
non-streamed answer to a prompt carrying `#hard` ends with `finish_reason: length` for
`--fail-share` of them (the simulator's `hard_marker` fault, docs/sim.md).

Workload (seeded): `--requests` non-streamed chat requests, `--concurrency` in flight.
`--hard-share` of them are hard; half of those *look* hard (a long code prompt and a large
`max_tokens`: the built-in heuristic classifier scores them high and a `min_score` rule
sends them to the large tier), the other half look easy (short) and are only caught by
escalation when the small tier fails them. Easy requests are short questions.

Two runs of the same requests: `tiered` (`model: auto`, the classifier rule, escalation on
`length`) and `all-large` (the same name with the hint header `x-kvgate-tier: large`, so
the accounting is the same). Printed per run: traffic share per tier (answers and
attempts), escalation rate, cost per million total tokens of the answers (the cost of
escalated attempts included, their tokens not), the ledger's saving against all-largest,
time to the answer's first byte (non-streamed: the whole answer) p50/p90, wall time; and
the decision cost per request (`TiersRuntime.decide`: hint, stickiness, rules, classifier)
and of the classifier alone, timed in-process over the workload's bodies.

    python loadtests/bench_tiers.py [--requests 400] [--concurrency 16] [--hard-share 0.3]
        [--fail-share 0.8] [--small-price 0.2] [--large-price 1.0] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.app import build_app
from gateway.serving import start_server
from gateway.settings import load_settings
from gateway.sim.faults import FaultConfig
from gateway.sim.profiles import PROFILES
from gateway.sim.server import SimEngine
from gateway.tiers.config import TiersSettings
from gateway.tiers.features import FeaturesClassifier
from gateway.tiers.runtime import TiersRuntime
from gateway.types import ClusterView, Endpoint

HARD = "#hard"
LARGE_PROFILE = PROFILES["h200-sparse"]
SMALL_PROFILE = LARGE_PROFILE.scaled(
    name="small",
    prefill_tokens_per_s=LARGE_PROFILE.prefill_tokens_per_s * 3,
    decode_base_s=LARGE_PROFILE.decode_base_s / 3,
    decode_per_seq_s=LARGE_PROFILE.decode_per_seq_s / 3,
)


@dataclass(frozen=True, slots=True)
class Job:
    body: dict[str, Any]
    hard: bool


def workload(n: int, hard_share: float, seed: int) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        hard = rng.random() < hard_share
        if hard and rng.random() < 0.5:
            code = "for i in range(n):\n    total += x[i] * w[i] - b / 2\n" * rng.randint(30, 90)
            content = f"req {i}: ```py\n{code}```\nwhy is this slow? {HARD}"
            max_tokens = rng.choice([512, 1024])
        elif hard:
            content = f"req {i}: prove the lemma about {rng.randint(1, 999)} {HARD}"
            max_tokens = 300
        else:
            content = f"req {i}: what is a good name for a {rng.choice(['cat', 'dog', 'boat'])}?"
            max_tokens = 300
        body = {
            "model": "auto",
            "messages": [{"role": "user", "content": content}],
            # Above the simulator's natural lengths (16..256): answers end with "stop"
            # unless the small engine fails them.
            "max_tokens": max_tokens,
        }
        jobs.append(Job(body, hard))
    return jobs


def tiers_section(small_price: float, large_price: float) -> dict[str, Any]:
    return {
        "models": [
            {
                "name": "auto",
                "tiers": [
                    {
                        "name": "small",
                        "model": "small-7b",
                        "price_per_1m_tokens": small_price,
                        "escalate": {"checks": ["length", "content_filter", "empty"]},
                    },
                    {"name": "large", "model": "large-70b", "price_per_1m_tokens": large_price},
                ],
                "rules": [{"tier": "large", "min_score": 0.7}],
                "classifier": {"name": "features"},
            }
        ]
    }


@dataclass
class RunResult:
    name: str
    wall_s: float
    ttfb: list[float]
    answers: dict[str, int]
    attempts: dict[str, int]
    escalations: int
    cost: float
    tokens: int
    errors: int
    saved: float


async def run(name: str, jobs: list[Job], args: argparse.Namespace, hint: str | None) -> RunResult:
    faults = FaultConfig(hard_marker=HARD, hard_fail_rate=args.fail_share)
    small = SimEngine(SMALL_PROFILE, index=0, model_name="small-7b", faults=faults, seed=args.seed)
    large = SimEngine(LARGE_PROFILE, index=1, model_name="large-70b", seed=args.seed)
    for engine in (small, large):
        await engine.start()
    settings = load_settings(
        replicas=[{"id": "small-0", "url": small.url}, {"id": "large-0", "url": large.url}],
        tiers=tiers_section(args.small_price, args.large_price),
    )
    app = build_app(settings)
    server = await start_server(app, http=settings.server.protocol())
    runtime: TiersRuntime = app.state.gateway.tiers
    ttfb: list[float] = []
    answers: dict[str, int] = {}
    errors = 0
    headers = {"x-kvgate-tier": hint} if hint else {}
    queue: asyncio.Queue[Job] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal errors
        while not queue.empty():
            job = queue.get_nowait()
            t0 = time.perf_counter()
            async with client.stream(
                "POST", "/v1/chat/completions", json=job.body, headers=headers
            ) as response:
                first = time.perf_counter()
                await response.aread()
            if response.status_code != 200:
                errors += 1
                continue
            ttfb.append(first - t0)
            tier = response.headers.get("x-kvgate-tier", "?")
            answers[tier] = answers.get(tier, 0) + 1

    start = time.perf_counter()
    try:
        limits = httpx.Limits(max_connections=args.concurrency)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as client:
            await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
        wall = time.perf_counter() - start
    finally:
        await server.stop()
        for engine in (small, large):
            await engine.stop()
    ledger = runtime.ledger
    attempts = {tier: n for (_, tier), n in ledger.requests.items()}
    tokens = sum(ledger.answered_tokens.values())
    return RunResult(
        name,
        wall,
        ttfb,
        answers,
        attempts,
        sum(ledger.escalations.values()),
        sum(ledger.cost.values()),
        tokens,
        errors,
        sum(ledger.saved().values()),
    )


def decision_cost(jobs: list[Job], repeat: int) -> tuple[float, float, float]:
    """Mean and p99 µs of `TiersRuntime.decide` per request, and mean µs of the classifier."""
    settings = TiersSettings.model_validate(tiers_section(0.2, 1.0))
    runtime = TiersRuntime(settings, lambda: ClusterView(replicas=()))
    ladder = runtime.ladders["auto"]
    samples = []
    for _ in range(repeat):
        for job in jobs:
            t0 = time.perf_counter_ns()
            runtime.decide(ladder, Endpoint.CHAT, job.body, ())
            samples.append(time.perf_counter_ns() - t0)
    samples.sort()
    clf = FeaturesClassifier(FeaturesClassifier.Config())
    t0 = time.perf_counter_ns()
    for _ in range(repeat):
        for job in jobs:
            clf.classify(Endpoint.CHAT, job.body)
    clf_mean = (time.perf_counter_ns() - t0) / (repeat * len(jobs)) / 1e3
    return statistics.fmean(samples) / 1e3, samples[int(len(samples) * 0.99)] / 1e3, clf_mean


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


def report(r: RunResult) -> None:
    answered = sum(r.answers.values()) or 1
    attempts = sum(r.attempts.values()) or 1
    share = ", ".join(f"{t} {n / answered:.1%}" for t, n in sorted(r.answers.items()))
    tried = ", ".join(f"{t} {n / attempts:.1%}" for t, n in sorted(r.attempts.items()))
    per_m = r.cost / r.tokens * 1e6 if r.tokens else float("nan")
    print(f"[{r.name}]")
    print(f"  answers by tier      {share}  ({answered} answered, {r.errors} errors)")
    print(f"  attempts by tier     {tried}  ({attempts} attempts)")
    print(f"  escalations          {r.escalations} ({r.escalations / answered:.1%} of requests)")
    print(
        f"  cost                 {per_m:.4f} per M total tokens of the answers ({r.tokens:,}"
        f" tokens; escalated attempts paid, not counted as tokens); saved vs all-largest"
        f" {r.saved:.6f}"
    )
    print(
        f"  first byte (answer)  p50 {pct(r.ttfb, 0.5) * 1e3:.0f} ms"
        f"  p90 {pct(r.ttfb, 0.9) * 1e3:.0f} ms   wall {r.wall_s:.1f} s"
    )


async def main_async(args: argparse.Namespace) -> None:
    jobs = workload(args.requests, args.hard_share, args.seed)
    hard = sum(j.hard for j in jobs)
    print(
        f"{len(jobs)} requests, {hard} hard ({hard / len(jobs):.0%}), small tier fails"
        f" {args.fail_share:.0%} of hard ones; prices small {args.small_price} large"
        f" {args.large_price} per M tokens (assumed)"
    )
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    tiered = await run("tiered", jobs, args, None)
    report(tiered)
    large = await run("all-large", jobs, args, "large")
    report(large)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    tiered_cost = tiered.cost / tiered.tokens if tiered.tokens else 0.0
    large_cost = large.cost / large.tokens if large.tokens else 0.0
    if large_cost:
        print(f"cost per token, tiered vs all-large: {tiered_cost / large_cost:.1%}")
    mean_us, p99_us, clf_us = decision_cost(jobs, args.decision_repeat)
    print(
        f"decision cost per request: mean {mean_us:.1f} us, p99 {p99_us:.1f} us"
        f" (classifier alone mean {clf_us:.1f} us; target < 50 us)"
    )
    used = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    load = os.getloadavg()
    print(
        f"machine: {os.cpu_count()} CPUs, load average {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}"
        f" (shared with other work); this process used {used:.1f} s CPU"
        f" over {tiered.wall_s + large.wall_s:.1f} s wall"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--hard-share", type=float, default=0.3)
    parser.add_argument("--fail-share", type=float, default=0.8)
    parser.add_argument("--small-price", type=float, default=0.2)
    parser.add_argument("--large-price", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--decision-repeat", type=int, default=20)
    args = parser.parse_args()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
