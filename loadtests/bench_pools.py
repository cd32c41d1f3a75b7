"""Dynamic pool weights against a static 50/50 split, on two simulated card pools.

Two replicas of a fast, expensive profile (`h200-sparse`) and two of a slower, cheap one
(`domestic`) sit behind a real gateway. Multi-turn, prefill-heavy sessions (a shared system
prompt, a per-session task, growing history, short answers) arrive open-loop along a load
ramp: low, up, peak, down, low. The same traffic (same seed) runs twice, once with the weight
controller and once with it disabled at 50/50. Printed: a per-interval timeline (weights,
share of requests, utilisation per pool) and a per-phase table (share, utilisation, TTFT
p50/p99, cost per 1,000 total and output tokens, total-token throughput), then the verdict
against the targets: cost at least 20% lower at equal or better TTFT p99 in the low phases,
no TTFT p99 regression at the peak.

Cost basis: busy (replica-hour price x time the replica had a request in flight; see
gateway.pools.cost). Prices are per card-hour, 8 cards per replica.

With `--ttft-target` (seconds) the dynamic run's controller also reads each pool's recent
first-byte times (quantile `--ttft-quantile` over 10 s) as utilisation (the simulator, like
vLLM, sends its first stream chunk with the first token, so first byte = TTFT); with
`--ttft-max-uncached N` only requests with at most N uncached prompt tokens feed it.
With `--idle-release`, sessions idle that long follow the weights. `--spill N` (default 1;
0: off) sets `spill_new_sessions_at`: a new session whose weighted pool has N requests in
flight on every replica starts on a replica with room in the other pool. `--warm` (on by
default; `--no-warm` turns it off) enables `warm_moves`: after a turn on a pool the weights
no longer give the session, its prompt is prefilled on an idle replica of the weighted pool
and the session moves there (`--warm-interval`: `min_interval_s`; `--warm-max-prompt`:
`max_prompt_tokens`, default 65536 here, the domestic profile's context, so no session is
too long to move; `--warm-slice`: `slice_tokens`, default 256 here: the domestic profile
prefills about 4,500 tokens per second, so a live request waits at most about 60 ms
behind a warm-up's slice; `--no-warm-pressure`: also move sessions onto the pricier pool
while their own pool is under the high watermark). `--long-prefill N` runs every engine of both variants with
vLLM's `long_prefill_token_threshold` N (default off).
The defaults are the configuration docs/pools.md reports; with warm moves the load answers
the weights within a turn, so the dwell is 2 steps, not 5.
`--new-sessions-pool P` starts every new session on pool P while it is not saturated. The
static run has none of these.
p99 over ~115 requests per low phase is the 2nd-slowest request: repeat runs and read the
spread, and `--tails` shows which requests made it. `--dump FILE` keeps every request and
each phase's cost ledger; `loadtests/pools_pooled.py FILE...` pools several seeds into one
verdict (p99 over all their low-phase requests, cost over all their tokens).

    python loadtests/bench_pools.py [--scale 1.0] [--rate-scale 1.0] [--seed 1] [--tails]
        [--policy prefix_affinity] [--low-watermark 0.4] [--high-watermark 0.7]
        [--smoothing 0.5] [--dwell 2] [--return-dwell 2] [--ttft-target 0] [--ttft-quantile 1.0]
        [--ttft-max-uncached 0] [--idle-release 0] [--spill 1] [--no-warm]
        [--warm-interval 60] [--warm-max-prompt 65536] [--warm-slice 256] [--no-warm-pressure]
        [--long-prefill 0] [--new-sessions-pool h200] [--dump FILE] [--dynamic-only]

The dynamic table is followed by the number of weight moves and direction reversals per
phase (how much the weights flap) and a timeline.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pools_pooled import LOW_PHASES, p, verdict  # one estimator and one target for both

from gateway.app import build_app
from gateway.pools.runtime import PoolsRuntime
from gateway.serving import start_server
from gateway.settings import load_settings
from gateway.sim.profiles import PROFILES
from gateway.sim.server import SimEngine

MODEL = "glm-bench"
POOLS = ("h200", "domestic")
PROFILE = {"h200": "h200-sparse", "domestic": "domestic"}
# (name, requests per second, seconds) at --scale 1 / --rate-scale 1
PHASES = (
    # Not judged: fills the prefix caches and lets the controller leave its initial split,
    # so neither variant's figures carry the cold start of a fresh gateway and engines.
    ("warm-up", 2.0, 20.0),
    ("low", 2.0, 60.0),
    ("ramp-up", 5.0, 20.0),
    ("peak", 9.0, 40.0),
    ("ramp-down", 5.0, 20.0),
    ("low-2", 2.0, 60.0),
)
# A user sends a turn about every THINK_S seconds, so `rate * THINK_S` sessions are active;
# when the rate drops, users leave (random ones), as they do when a peak passes.
THINK_S = 15.0
SYSTEM_TOKENS, TASK_TOKENS, TURN_TOKENS = 2000, 800, 250
CHARS_PER_TOKEN = 4
# Sequences per replica before TTFT suffers under this prefill-heavy traffic (utilisation 1.0).
SLOTS = {"h200": 12, "domestic": 4}


def pools_config(dynamic: bool, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "pools": [
            {
                "name": "h200",
                "hardware": "H200",
                "origin": "imported",
                "price_per_card_hour": 4.5,
                "cards_per_replica": 8,
                "capabilities": ["fp8", "fp4"],
                "slots_per_replica": SLOTS["h200"],
            },
            {
                "name": "domestic",
                "hardware": "domestic-accelerator",
                "origin": "domestic",
                "price_per_card_hour": 0.9,
                "cards_per_replica": 8,
                "capabilities": ["fp8"],
                "slots_per_replica": SLOTS["domestic"],
            },
        ],
        "models": [{"name": MODEL}],
        "initial_weights": {"h200": 0.5, "domestic": 0.5},
        # The static split gets none of these mechanisms: it is the unchanged baseline.
        "session_idle_release_s": args.idle_release if dynamic and args.idle_release else None,
        "spill_new_sessions_at": args.spill if dynamic and args.spill else None,
        "warm_moves": {
            "enabled": dynamic and args.warm,
            "min_interval_s": args.warm_interval,
            "max_prompt_tokens": args.warm_max_prompt,
            "slice_tokens": args.warm_slice,
            "pricier_only_under_pressure": args.warm_pressure,
        },
        "new_sessions_pool": args.new_sessions_pool if dynamic else None,
        "controller": {
            "enabled": dynamic,
            "interval_s": 1.0,
            "low_watermark": args.low_watermark,
            "high_watermark": args.high_watermark,
            "hysteresis": 0.05,
            "dwell_steps": args.dwell,
            "return_dwell_steps": args.return_dwell,
            "max_step": 0.15,
            "saturation": 0.9,
            "smoothing": args.smoothing,
            "ttft_target_s": args.ttft_target if dynamic and args.ttft_target else None,
            "ttft_quantile": args.ttft_quantile,
            "ttft_window_s": 10.0,
            "ttft_max_uncached_tokens": args.ttft_max_uncached or None,
        },
    }


@dataclass
class Session:
    sid: str
    prompt: str
    turns_left: int


class Traffic:
    """Deterministic multi-turn sessions: mostly follow-up turns, some new sessions, an
    active set sized by the current rate."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.system = self._text(SYSTEM_TOKENS)
        self.active: list[Session] = []
        self.count = 0

    def _text(self, tokens: int) -> str:
        return self.rng.randbytes(tokens * CHARS_PER_TOKEN // 2).hex()

    def next(self, rate: float) -> tuple[str, str, int]:
        target = max(3, round(rate * THINK_S))
        while len(self.active) > target:
            self.active.pop(self.rng.randrange(len(self.active)))
        if len(self.active) < target or self.rng.random() < 0.1:
            self.count += 1
            self.active.append(
                Session(
                    f"s{self.count}", self.system + self._text(TASK_TOKENS), self.rng.randint(4, 12)
                )
            )
        session = self.rng.choice(self.active)
        session.prompt += self._text(TURN_TOKENS)
        session.turns_left -= 1
        if session.turns_left <= 0:
            self.active.remove(session)
        return session.sid, session.prompt, self.rng.randint(16, 48)


@dataclass
class Result:
    phase: str
    pool: str
    ttft: float | None
    ok: bool
    uncached: int = -1
    at: float = 0.0
    error: str = ""  # why a failed request failed (status and message, or the exception)
    sid: str = ""


@dataclass
class Sample:
    t: float
    phase: str
    weights: dict[str, float]
    util: dict[str, float | None]


@dataclass
class Run:
    label: str
    results: list[Result] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    phase_cost: dict[str, dict[str, Any]] = field(default_factory=dict)
    warm: dict[str, Any] = field(default_factory=dict)
    # Warm-move counters at each phase's start (admin payload), for per-phase deltas.
    warm_at: dict[str, dict[str, int]] = field(default_factory=dict)


async def one_request(
    http: httpx.AsyncClient,
    sid: str,
    prompt: str,
    max_tokens: int,
    phase: str,
    run: Run,
    pool_of: dict[str, str],
    since: float,
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft: float | None = None
    pool, ok, uncached, error = "?", False, -1, ""
    try:
        async with http.stream(
            "POST",
            "/v1/chat/completions",
            content=orjson.dumps(body),
            headers={"content-type": "application/json", "x-session-id": sid},
        ) as resp:
            pool = pool_of.get(resp.headers.get("x-kvgate-replica", ""), "?")
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {(await resp.aread())[:160].decode(errors='replace')}"
            async for line in resp.aiter_lines():
                if (
                    ttft is None
                    and line.startswith("data:")
                    and '"content":"' in line
                    and '"content":""' not in line
                ):
                    ttft = time.perf_counter() - t0
                elif line.startswith("data: {") and '"usage":{' in line:
                    use = orjson.loads(line[6:])["usage"]
                    cached = (use.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    uncached = use["prompt_tokens"] - cached
            ok = resp.status_code == 200
    except httpx.HTTPError as exc:
        ok, error = False, f"{type(exc).__name__}: {exc}"
    run.results.append(Result(phase, pool, ttft, ok, uncached, t0 - since, error, sid))


def cost_snapshot(runtime: PoolsRuntime) -> dict[str, tuple[float, int, int, int]]:
    return {
        name: (
            pc.cost["busy"],
            pc.total_tokens,
            pc.completion_tokens,
            pc.requests,
            pc.prompt_tokens,
            pc.cached_tokens,
        )
        for name, pc in runtime.ledger.summary().items()
    }


def warm_counts(runtime: PoolsRuntime) -> dict[str, int]:
    """Flat warm-move counters: `<from>-><to> <result>` and `skip <reason>`."""
    warm = runtime.admin_payload()["warm_moves"]
    out = {f"{d['from']}->{d['to']} {d['result']}": int(d["count"]) for d in warm.get("done", [])}
    out.update({f"skip {why}": int(n) for why, n in warm.get("skipped", {}).items()})
    return out


def warm_by_phase(run: Run) -> None:
    names = [p[0] for p in PHASES] + ["end"]
    print("\nprefix warm-ups and skips per phase (dynamic):")
    for name, nxt in itertools.pairwise(names):
        a, b = run.warm_at.get(name, {}), run.warm_at.get(nxt, {})
        delta = {k: b.get(k, 0) - a.get(k, 0) for k in b}
        print(
            f"  {name:<10} "
            + (", ".join(f"{k} {v}" for k, v in sorted(delta.items()) if v) or "none")
        )


async def run_variant(dynamic: bool, args: argparse.Namespace) -> Run:
    run = Run("dynamic" if dynamic else "static 50/50")
    engines: dict[str, list[SimEngine]] = {
        pool: [
            SimEngine(
                PROFILES[PROFILE[pool]].scaled(long_prefill_token_threshold=args.long_prefill),
                index=i,
                model_name=MODEL,
                seed=i,
            )
            for i in range(2)
        ]
        for pool in POOLS
    }
    for group in engines.values():
        for engine in group:
            await engine.start()
    replicas = [
        {"id": f"{pool}-{e.index}", "url": e.url, "pool": pool, "models": [MODEL]}
        for pool, group in engines.items()
        for e in group
    ]
    pool_of = {r["id"]: r["pool"] for r in replicas}
    settings = load_settings(
        replicas=replicas,
        pools=pools_config(dynamic, args),
        routing={"policy": args.policy},
        server={"log_level": "warning"},
    )
    app = build_app(settings)
    server = await start_server(app)
    runtime: PoolsRuntime = app.state.gateway.extras["pools"]
    traffic = Traffic(args.seed)
    tasks: set[asyncio.Task[None]] = set()
    arrivals = random.Random(args.seed + 1)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as http:

        async def sampler() -> None:
            while True:
                await asyncio.sleep(args.sample_s)
                snap = runtime.controller.snapshot
                run.samples.append(
                    Sample(
                        time.perf_counter() - start,
                        current[0],
                        dict(snap.weights),
                        dict(snap.utilisation),
                    )
                )

        current = [PHASES[0][0]]
        sampling = asyncio.create_task(sampler())
        for name, rate, seconds in PHASES:
            current[0] = name
            before = cost_snapshot(runtime)
            run.warm_at[name] = warm_counts(runtime)
            t_start = time.perf_counter()
            t_end = t_start + seconds * args.scale
            phase_tasks: set[asyncio.Task[None]] = set()
            while True:
                await asyncio.sleep(arrivals.expovariate(rate * args.rate_scale))
                if time.perf_counter() >= t_end:
                    break
                sid, prompt, max_tokens = traffic.next(rate * args.rate_scale)
                task = asyncio.create_task(
                    one_request(http, sid, prompt, max_tokens, name, run, pool_of, t_start)
                )
                tasks.add(task)
                phase_tasks.add(task)
                task.add_done_callback(tasks.discard)
            run.phase_cost[name] = {"before": before, "tasks": phase_tasks}
        await asyncio.gather(*tasks)
        sampling.cancel()
    # Cost per phase: the ledger's deltas from each phase's start to the next phase's start
    # (requests are charged when they finish, so a phase's tail lands in the next one).
    names = [p[0] for p in PHASES]
    final = cost_snapshot(runtime)
    for i, name in enumerate(names):
        before = run.phase_cost[name]["before"]
        after = run.phase_cost[names[i + 1]]["before"] if i + 1 < len(names) else final
        run.phase_cost[name] = {
            pool: tuple(a - b for a, b in zip(after[pool], before[pool])) for pool in after
        }
    run.warm = runtime.admin_payload()["warm_moves"]
    run.warm_at["end"] = warm_counts(runtime)
    await server.stop()
    for group in engines.values():
        for engine in group:
            await engine.stop()
    return run


def phase_table(run: Run, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    print(f"\n== {run.label} ==")
    print(
        f"{'phase':<10} {'req':>5} {'ttft n':>6} {'fail':>4} {'share h200/dom':>15} {'util h200/dom':>14} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'p99 h200/dom':>13} {'hit h200/dom':>13}"
        f" {'$/1k tok':>9} {'$/1k out':>9} {'tok/s':>8}"
    )
    out: dict[str, dict[str, float]] = {}
    tails: list[str] = []
    for name, _, seconds in PHASES:
        rs = [r for r in run.results if r.phase == name]
        ttfts = [r.ttft for r in rs if r.ttft is not None]
        served = [r for r in rs if r.pool in POOLS]
        share = {pool: sum(r.pool == pool for r in served) / max(len(served), 1) for pool in POOLS}
        utils = {pool: [s.util.get(pool) for s in run.samples if s.phase == name] for pool in POOLS}
        util = {
            pool: statistics.fmean(u for u in us if u is not None)
            if any(u is not None for u in us)
            else float("nan")
            for pool, us in utils.items()
        }
        cost, total, output, *_ = run.phase_cost[name]["all"]
        hits = {
            pool: run.phase_cost[name][pool][5] / max(run.phase_cost[name][pool][4], 1)
            for pool in POOLS
        }
        per_total = cost * 1000 / total if total else float("nan")
        per_out = cost * 1000 / output if output else float("nan")
        tps = total / (seconds * args.scale)
        fails = sum(not r.ok for r in rs)
        by_pool = {
            pool: p([r.ttft for r in rs if r.pool == pool and r.ttft is not None], 0.99)
            for pool in POOLS
        }
        out[name] = {"p99": p(ttfts, 0.99), "cost": per_total}
        slow = sorted((r for r in rs if r.ttft is not None), key=lambda r: -(r.ttft or 0))[:3]
        tails.append(
            f"{name}: "
            + ", ".join(f"{r.ttft:.2f}s {r.pool} {r.uncached} uncached @{r.at:.0f}s" for r in slow)
        )
        print(
            f"{name:<10} {len(rs):>5} {len(ttfts):>6} {fails:>4} {share['h200']:>7.2f}/{share['domestic']:<7.2f}"
            f" {util['h200']:>6.2f}/{util['domestic']:<7.2f} {p(ttfts, 0.5):>9.3f}"
            f" {p(ttfts, 0.99):>9.3f} {by_pool['h200']:>6.2f}/{by_pool['domestic']:<6.2f}"
            f" {hits['h200']:>6.2f}/{hits['domestic']:<6.2f}"
            f" {per_total:>9.6f} {per_out:>9.5f} {tps:>8.0f}"
        )
    if args.tails:
        print("slowest TTFTs: " + "\n               ".join(tails))
        # Where a low phase's imported-pool turns come from: sessions running one turn there
        # (then moved) or several (no move yet: no idle replica, moved recently, ...).
        for name in LOW_PHASES:
            per: dict[str, int] = {}
            for r in run.results:
                if r.phase == name and r.pool == "h200":
                    per[r.sid] = per.get(r.sid, 0) + 1
            hist = {k: sum(1 for v in per.values() if min(v, 3) == k) for k in (1, 2, 3)}
            print(
                f"{name} turns on h200: {sum(per.values())} by {len(per)} sessions "
                f"(1 turn: {hist[1]}, 2: {hist[2]}, 3+: {hist[3]})"
            )
    for r in run.results:
        if not r.ok:
            print(f"failed: {r.phase} @{r.at:.0f}s on {r.pool}: {r.error or 'no reason recorded'}")
    return out


def reversals(run: Run) -> None:
    """Weight moves and direction reversals per phase (sampled every --sample-s)."""
    parts = []
    for name, _, _ in PHASES:
        ws = [s.weights["domestic"] for s in run.samples if s.phase == name]
        deltas = [b - a for a, b in itertools.pairwise(ws) if abs(b - a) > 1e-9]
        flips = sum((a > 0) != (b > 0) for a, b in itertools.pairwise(deltas))
        parts.append(f"{name} {len(deltas)}/{flips}")
    print(f"\nweight moves/reversals per phase ({run.label}): " + ", ".join(parts))


def timeline(run: Run) -> None:
    reversals(run)
    print(f"\n-- timeline ({run.label}): t, phase, weight h200/domestic, util h200/domestic --")
    for s in run.samples[:: max(1, len(run.samples) // 40)]:
        u = [f"{s.util.get(pool) or 0:.2f}" for pool in POOLS]
        print(
            f"{s.t:6.1f}s {s.phase:<10} w={s.weights['h200']:.2f}/{s.weights['domestic']:.2f}"
            f"  util={u[0]}/{u[1]}"
        )


def dump(args: argparse.Namespace, runs: list[Run]) -> None:
    """Every request and each phase's cost ledger, for pooling several seeds
    (loadtests/pools_pooled.py)."""
    out = {
        "seed": args.seed,
        "phases": [p[0] for p in PHASES],
        "runs": {
            ("dynamic" if r.label == "dynamic" else "static"): {
                "results": [
                    {
                        "phase": x.phase,
                        "pool": x.pool,
                        "ttft": x.ttft,
                        "ok": x.ok,
                        "uncached": x.uncached,
                        "at": x.at,
                        "sid": x.sid,
                    }
                    for x in r.results
                ],
                # pool -> (cost, total tokens, output tokens, requests, prompt, cached prompt)
                "cost": {
                    ph: {pool: list(v) for pool, v in by.items()} for ph, by in r.phase_cost.items()
                },
            }
            for r in runs
        },
    }
    Path(args.dump).write_bytes(orjson.dumps(out))


async def main(args: argparse.Namespace) -> None:
    print(
        "pools: h200 (h200-sparse, 2 replicas, 8 cards x 4.50/h), "
        "domestic (domestic, 2 replicas, 8 cards x 0.90/h); cost basis: busy"
    )
    warm = (
        f"on (min_interval_s {args.warm_interval:g}, max_prompt_tokens "
        f"{args.warm_max_prompt}, slice_tokens {args.warm_slice or 'off'}, "
        f"pricier_only_under_pressure {args.warm_pressure})"
        if args.warm
        else "off"
    )
    print(
        f"engines: long_prefill_token_threshold={args.long_prefill or 'off'} (both pools, both runs)"
    )
    print(
        f"router inside each pool: {args.policy}; phases (req/s, s): "
        + ", ".join(f"{n} {r * args.rate_scale:g}/{s * args.scale:g}" for n, r, s in PHASES)
    )
    print(
        f"dynamic run: low_watermark={args.low_watermark:g}, "
        f"high_watermark={args.high_watermark:g}, smoothing={args.smoothing:g}, "
        f"dwell_steps={args.dwell}, "
        f"return_dwell_steps={args.return_dwell}, ttft_target_s={args.ttft_target or 'off'} "
        f"(quantile {args.ttft_quantile:g}, max uncached {args.ttft_max_uncached or 'any'}), "
        f"session_idle_release_s={args.idle_release or 'off'}, "
        f"spill_new_sessions_at={args.spill or 'off'}, "
        f"warm_moves={warm}, "
        f"new_sessions_pool={args.new_sessions_pool or 'unset'}; 'ttft n' = samples behind "
        "each p99 (with n samples, p99 is the ceil(n/100)-th slowest)"
    )
    static = None if args.dynamic_only else await run_variant(False, args)
    dynamic = await run_variant(True, args)
    s_tab = phase_table(static, args) if static is not None else None
    d_tab = phase_table(dynamic, args)
    timeline(dynamic)
    if dynamic.warm.get("enabled"):
        print(
            "\nprefix warm-ups (dynamic): "
            + (
                ", ".join(
                    f"{d['from']}->{d['to']} {d['result']} {d['count']}"
                    for d in dynamic.warm["done"]
                )
                or "none"
            )
            + "; not warmed when the turn ended: "
            + (", ".join(f"{why} {n}" for why, n in dynamic.warm["skipped"].items()) or "none")
        )
        warm_by_phase(dynamic)
    if args.dump:
        dump(args, [r for r in (static, dynamic) if r is not None])
    if s_tab is None:
        return
    print("\n== verdict (dynamic vs static) ==")
    for name, _, _ in PHASES:
        s, d = s_tab[name], d_tab[name]
        saving, met = verdict((s["p99"], s["cost"]), (d["p99"], d["cost"]), name)
        line = f"{name:<10} cost {saving:+.1%} lower, TTFT p99 {d['p99']:.3f}s vs {s['p99']:.3f}s"
        if name in LOW_PHASES:
            line += f"  target (>=20% cheaper, p99 <= static): {'MET' if met else 'NOT MET'}"
        elif name == "peak":
            line += f"  target (p99 <= static): {'MET' if met else 'NOT MET'}"
        print(line)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies phase durations")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="multiplies arrival rates")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--policy", default="prefix_affinity", help="router inside each pool")
    parser.add_argument("--sample-s", type=float, default=1.0)
    parser.add_argument("--tails", action="store_true", help="print each phase's slowest TTFTs")
    parser.add_argument("--low-watermark", type=float, default=0.4)
    parser.add_argument(
        "--ttft-target",
        type=float,
        default=0.0,
        help="controller ttft_target_s for the dynamic run (0: off)",
    )
    parser.add_argument(
        "--ttft-quantile",
        type=float,
        default=1.0,
        help="controller ttft_quantile (1.0: the slowest in the window)",
    )
    parser.add_argument(
        "--ttft-max-uncached",
        type=int,
        default=0,
        help="controller ttft_max_uncached_tokens (0: every request counts)",
    )
    parser.add_argument("--high-watermark", type=float, default=0.7)
    parser.add_argument(
        "--smoothing",
        type=float,
        default=0.5,
        help="controller smoothing (weight of the newest sample)",
    )
    parser.add_argument(
        "--dynamic-only",
        action="store_true",
        help="skip the static split (exploration; the verdict needs both)",
    )
    parser.add_argument(
        "--dump",
        default=None,
        metavar="FILE",
        help="write every request and the per-phase cost ledger as JSON "
        "(pool several seeds with loadtests/pools_pooled.py)",
    )
    parser.add_argument("--dwell", type=int, default=2, help="controller dwell_steps")
    parser.add_argument("--return-dwell", type=int, default=2, help="controller return_dwell_steps")
    parser.add_argument(
        "--idle-release",
        type=float,
        default=0.0,
        help="session_idle_release_s for the dynamic run (0: off)",
    )
    parser.add_argument(
        "--warm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="warm_moves for the dynamic run: placed sessions follow the "
        "weights after their prefix was prefilled on the new pool",
    )
    parser.add_argument(
        "--warm-interval",
        type=float,
        default=60.0,
        help="warm_moves.min_interval_s: a session moves at most this often",
    )
    parser.add_argument(
        "--long-prefill",
        type=int,
        default=0,
        help="engines' long_prefill_token_threshold (vLLM's "
        "--long-prefill-token-threshold), both pools and both runs; 0: off",
    )
    parser.add_argument(
        "--warm-slice",
        type=int,
        default=256,
        help="warm_moves.slice_tokens: warm in growing prefixes this many tokens "
        "apart, each only while the replica is idle (0: one request)",
    )
    parser.add_argument(
        "--warm-pressure",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="warm_moves.pricier_only_under_pressure: onto the pricier pool only "
        "while the session's pool is at or above the high watermark",
    )
    parser.add_argument(
        "--warm-max-prompt",
        type=int,
        default=65536,
        help="warm_moves.max_prompt_tokens: longer sessions are not moved",
    )
    parser.add_argument(
        "--new-sessions-pool",
        default=None,
        choices=POOLS,
        help="new_sessions_pool for the dynamic run (default: unset)",
    )
    parser.add_argument(
        "--spill", type=int, default=1, help="spill_new_sessions_at for the dynamic run (0: off)"
    )
    asyncio.run(main(parser.parse_args()))
