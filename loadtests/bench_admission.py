"""Admission control under overload: priority classes and shortest-remaining-first.

Drives a gateway in front of simulated engines (real uvicorn servers on loopback) with an
open-loop Poisson mix -- a few long prompts, many short ones, two classes -- past
saturation, and prints per class and size: TTFT p50/p99, completion rate and 429s. Runs:

  unloaded   the same mix at a fraction of the rate, admission off (the reference TTFT)
  off        overload, admission off: engines queue first come, first served
  on         overload, admission on, once per `--variants` entry (same seeds as off):
             the gateway holds requests while the replica is saturated and releases them
             by class, then shortest predicted work, with aging

Variants (see VARIANTS): `headroom` (default) bounds the uncached prefill tokens in flight
per replica (`max_prefill_tokens`) so the top class always finds room in the engine's next
step, the low class gets about one prefill chunk, and the engines run vLLM priority
scheduling with the classes mapped onto `priority`; `headroom-fcfs` is the same on FCFS
engines; `prompt` is the earlier prompt-token budget (`max_prompt_tokens`), `prompt+prio`
the same on priority-scheduling engines. `name:field=value` changes one field.

Targets checked at the end: the high class's TTFT p99 under overload within 2x its
unloaded value (judged against the engine-only reference below, the HTTP one printed
beside it); short requests' mean TTFT at least 30% lower than with admission off;
every low-class request either completes (released within the wait bound) or gets a 429,
none lost.

    python loadtests/bench_admission.py [--runs 3] [--variants headroom,prompt]

Statistics: the overload runs repeat `--runs` times with different seeds; each run's
targets are printed, then all runs' samples pooled, then the spread of each figure. The
unloaded reference pools `--unloaded-runs` seeds and both classes per size (admission off
never reads the class): one minute of light load holds few overlaps of two long prompts,
which is what the short requests' p99 measures, so a single run's p99 swings several-fold
with the seed. An engine-only reference (the engine model in virtual time, an hour of
arrivals, no HTTP) is printed beside it to show what the measured p99 estimates. The
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
from dataclasses import asdict, dataclass, field, replace
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
from gateway.sim.engine import EngineModel, RequestHandle, SimRequest
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


@dataclass(frozen=True)
class Variant:
    """One way of running the overload with admission on (compared with the same "off")."""

    # max_prompt_tokens as a multiple of the long prompt (0: off)
    prompt_budget: float = 0.0
    # max_prefill_tokens as a fraction of the engine's max_num_batched_tokens (0: off)
    prefill_budget: float = 0.0
    # holdback of the low class (share of every threshold kept for better classes)
    low_holdback: float = 0.25
    backfill_s: float = 3.0
    # engines run vLLM priority scheduling and the gateway maps classes onto `priority`
    engine_priority: bool = False
    class_head_start_s: float = 3.0
    # engine waiting-queue threshold (0: off)
    max_waiting: float = 2.0


# The top class may fill an engine step but for one short prefill; the low class gets about
# one prefill chunk. The prefill budget bounds the engine's queue, so the waiting-queue
# threshold (a scraped, noisy signal that held the top class too) is off; the class head
# start exceeds the wait bound, so a queued top-class request always goes before the low class.
HEADROOM = Variant(
    prefill_budget=0.85,
    low_holdback=0.42,
    engine_priority=True,
    class_head_start_s=10.0,
    max_waiting=0.0,
)
VARIANTS = {
    # The configuration measured before: prompt-token budget, engines FCFS.
    "prompt": Variant(prompt_budget=2.0),
    # The same with vLLM priority scheduling on the engines.
    "prompt+prio": Variant(prompt_budget=2.0, engine_priority=True),
    "headroom": HEADROOM,
    # The same with the engines FCFS: what vLLM priority scheduling adds.
    "headroom-fcfs": replace(HEADROOM, engine_priority=False),
}


def parse_variant(spec: str) -> tuple[str, Variant]:
    """`name` or `name:field=value:...` (e.g. `headroom:low_holdback=0.6`)."""
    name, *changes = spec.strip().split(":")
    variant = VARIANTS[name]
    for change in changes:
        key, _, value = change.partition("=")
        fields = asdict(variant)
        current = fields[key]
        fields[key] = (
            value.lower() in ("1", "true", "yes") if isinstance(current, bool) else float(value)
        )
        variant = Variant(**fields)
    return spec.strip(), variant


def _admission(
    enabled: bool,
    slots: int,
    max_wait_s: float,
    variant: Variant = Variant(),
    batch_tokens: int = 2048,
    prefill_chunk: int = 0,
) -> dict[str, Any]:
    saturation: dict[str, Any] = {}
    if variant.prompt_budget:
        # Keeps long prefills from sharing the engine's step budget: at 2x, batch (held
        # back by a quarter) runs one long prefill at a time.
        saturation["max_prompt_tokens"] = int(variant.prompt_budget * Mix().long_tokens)
    if variant.prefill_budget:
        # Tokens per engine step of requests still prefilling; batch's holdback leaves
        # the rest of each step to the interactive class.
        saturation["max_prefill_tokens"] = int(variant.prefill_budget * batch_tokens)
        saturation["prefill_chunk_tokens"] = prefill_chunk or None
    return {
        "enabled": enabled,
        "classes": [
            {"name": HIGH},
            {"name": "default", "holdback": 0.1},
            {"name": LOW, "holdback": variant.low_holdback},
        ],
        "saturation": {
            "max_inflight": slots,
            "max_waiting": variant.max_waiting or None,
            "max_kv_usage": 0.9,
            **saturation,
        },
        "max_wait_s": max_wait_s,
        "class_head_start_s": variant.class_head_start_s,
        "size_head_start_s": 6.0,
        # A long prompt waiting for the token budget lets its class's short ones by for
        # this long, then blocks them (well within the aging bound).
        "backfill_s": variant.backfill_s,
        "work_cap_tokens": 8192,
        "max_queue": 4096,
    }


async def one_run(
    name: str,
    args: argparse.Namespace,
    rate: float,
    admission: dict[str, Any],
    seed: int = 0,
    engine_priority: bool = False,
) -> Run | float:
    """One load run (`rate` > 0), or a capacity measurement (`rate` == 0)."""
    duration = args.unloaded_duration if name.startswith("unloaded") else args.duration
    profile = PROFILES[args.profile].scaled(
        max_num_seqs=args.slots,
        max_num_batched_tokens=args.batch_tokens,
        long_prefill_token_threshold=args.long_prefill_threshold,
    )
    engines = [
        SimEngine(
            profile,
            index=i,
            seed=i,
            time_scale=args.time_scale,
            priority_scheduling=engine_priority,
        )
        for i in range(args.replicas)
    ]
    for e in engines:
        await e.start()
    settings = load_settings(
        replicas=[
            {
                "id": f"e{e.index}",
                "url": e.url,
                "models": [MODEL],
                "priority_scheduling": engine_priority,
            }
            for e in engines
        ],
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
    model_ref: dict[str, tuple[float, int]] | None = None,
) -> dict[str, float]:
    """Prints and returns the verdicts. With `model_ref` (the engine-only reference), the
    TTFT target is judged against it: its p99 rests on an hour of arrivals where the HTTP
    reference's rests on a few minutes, whose p99 swings several-fold with the seed."""
    print(f"\n== {title}")
    figures: dict[str, float] = {}
    for size in ("short", "long"):
        ref, got = unloaded[(HIGH, size)]["p99"], on[(HIGH, size)]["p99"]
        figures[f"high {size} p99 x(http)"] = got / ref
        line = (
            f"high {size:<5} TTFT p99: {got:.3f}s overloaded (n={on[(HIGH, size)]['ok']:.0f})"
            f" vs {ref:.3f}s unloaded over HTTP (n={unloaded[(HIGH, size)]['ok']:.0f}, x{got / ref:.2f})"
        )
        if model_ref is not None:
            mref, n = model_ref[size]
            figures[f"high {size} p99 x(model)"] = got / mref
            line += f", {mref:.3f}s engine-only (n={n}, x{got / mref:.2f})"
            ref = mref
        verdict = "met" if got <= 2 * ref else "MISSED"
        print(
            f"{line}; target <= x2 (judged on the {'engine-only' if model_ref else 'HTTP'} reference): {verdict}"
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


def spread(per_run: list[dict[str, float]], name: str = "") -> None:
    print(f"\n== {name} spread over {len(per_run)} runs (min / median / max)")
    for key in per_run[0]:
        values = sorted(f[key] for f in per_run)
        print(f"{key:<22}{values[0]:>8.2f}{statistics.median(values):>8.2f}{values[-1]:>8.2f}")


def engine_reference(
    args: argparse.Namespace, rate: float, seconds: float = 3600.0
) -> dict[str, tuple[float, int]]:
    """The light-load reference's TTFT from the engine model alone, in virtual time: no
    HTTP, so a lower bound, but with enough samples to show what the measured p99 estimates."""
    profile = PROFILES[args.profile].scaled(
        max_num_seqs=args.slots,
        max_num_batched_tokens=args.batch_tokens,
        long_prefill_token_threshold=args.long_prefill_threshold,
    )
    model = EngineModel(profile)
    mix = Mix()
    rng = random.Random(args.seed)
    arrivals: list[tuple[float, str]] = []
    t = rng.expovariate(rate)
    while t < seconds:
        arrivals.append((t, "long" if rng.random() < mix.long_share else "short"))
        t += rng.expovariate(rate)
    handles: list[tuple[RequestHandle, str]] = []
    now, i = 0.0, 0
    while i < len(arrivals) or model.has_work:
        while i < len(arrivals) and arrivals[i][0] <= now:
            at, size = arrivals[i]
            tokens = mix.long_tokens if size == "long" else mix.short_tokens
            blocks = tuple(range(i << 20, (i << 20) + tokens // profile.block_size))
            request = SimRequest(f"r{i}", tokens, blocks, max_tokens=mix.max_tokens)
            handles.append((model.submit(request, at), size))
            i += 1
        took = model.step(now)
        now = now + took if took else arrivals[i][0] if i < len(arrivals) else now
    print(f"engine-only light-load reference ({seconds:g}s of virtual time, no HTTP):")
    out: dict[str, tuple[float, int]] = {}
    for size in ("short", "long"):
        ttfts = [
            h.first_token_time - h.arrival
            for h, s in handles
            if s == size and h.first_token_time is not None
        ]
        print(
            f"  {size:<6} n={len(ttfts)} p50 {_pct(ttfts, 0.5):.3f}s p95 {_pct(ttfts, 0.95):.3f}s "
            f"p99 {_pct(ttfts, 0.99):.3f}s"
        )
        out[size] = (_pct(ttfts, 0.99), len(ttfts))
    return out


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
        "--unloaded-runs",
        type=int,
        default=3,
        help="light-load reference runs (seeds) pooled into the reference",
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
        "--variants",
        default="headroom",
        help=f"comma-separated admission-on variants to compare with the same off runs "
        f"({', '.join(VARIANTS)}); `name:field=value` changes a field",
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
    # One minute of light load holds a few overlaps of long prompts at most, and the short
    # requests' p99 depends on whether one fell in it: pool several seeds.
    references: list[Run] = []
    for i in range(args.unloaded_runs):
        ref = await one_run(
            f"unloaded {i + 1}/{args.unloaded_runs} (light load, admission off)",
            args,
            capacity * args.unloaded,
            off_cfg,
            args.seed + 100 * (i + 1) + 50,
        )
        assert isinstance(ref, Run)
        report(ref)
        references.append(ref)
    unloaded = merged(f"unloaded reference, {args.unloaded_runs} runs pooled", references)
    report(unloaded)
    t_unloaded = class_blind(unloaded)
    # One engine's share of the light load, in the engine's own time (RealClock runs
    # `time_scale` times faster than real); the p99s come back in wall seconds.
    model_ref = {
        size: (p99 / args.time_scale, n)
        for size, (p99, n) in engine_reference(
            args, capacity * args.unloaded / args.replicas / args.time_scale
        ).items()
    }
    variants = dict(parse_variant(spec) for spec in args.variants.split(","))
    for name, variant in variants.items():
        print(f"variant {name}: {variant}")
    offs: list[Run] = []
    ons: dict[str, list[Run]] = {name: [] for name in variants}
    per_run: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
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
        offs.append(off)
        for name, variant in variants.items():
            cfg = _admission(
                True,
                args.slots,
                args.max_wait,
                variant,
                args.batch_tokens,
                args.long_prefill_threshold,
            )
            on = await one_run(
                f"run {i + 1}/{args.runs}: overload, admission on ({name})",
                args,
                rate,
                cfg,
                seed,
                engine_priority=variant.engine_priority,
            )
            assert isinstance(on, Run)
            t_on = report(on)
            per_run[name].append(
                check(
                    t_unloaded,
                    t_off,
                    t_on,
                    on,
                    args.max_wait,
                    f"targets, run {i + 1}, {name}",
                    model_ref,
                )
            )
            ons[name].append(on)
    if args.runs > 1:
        pooled_off = report(merged(f"all {args.runs} runs pooled: admission off", offs))
        for name in variants:
            pooled_on_run = merged(f"all {args.runs} runs pooled: admission on ({name})", ons[name])
            pooled_on = report(pooled_on_run)
            check(
                t_unloaded,
                pooled_off,
                pooled_on,
                pooled_on_run,
                args.max_wait,
                f"targets, pooled, {name}",
                model_ref,
            )
            spread(per_run[name], name)


if __name__ == "__main__":
    asyncio.run(main())
