"""How many simulated requests per second one process sustains.

Two figures:

1. The engine model alone on a virtual clock (no HTTP): requests and engine steps per
   second of CPU, i.e. what the offline simulator can replay.
2. N engines served over real HTTP (uvicorn on loopback) with an in-process httpx load
   generator keeping `--concurrency` requests in flight, for `--duration` seconds. With the
   `instant` profile this is the cost of the HTTP surface; with a timed profile and a large
   `--time-scale` it is the throughput of the step loops.

    python loadtests/bench_sim.py [--replicas 8] [--profile instant] [--concurrency 64]
                                  [--duration 5] [--max-tokens 16] [--stream]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

# Runnable from a checkout without installing: the repository root holds gateway/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from gateway.sim.cluster import SimCluster
from gateway.sim.engine import EngineModel, SimRequest
from gateway.sim.profiles import PROFILES, get_profile


def bench_model(profile_name: str, requests: int, prompt_blocks: int, max_tokens: int) -> None:
    profile = get_profile("h200-sparse" if profile_name == "instant" else profile_name)
    model = EngineModel(profile)
    now = 0.0
    t0 = time.perf_counter()
    # 32 sessions sharing a system prompt, each request extending its session's prefix.
    for i in range(requests):
        session = i % 32
        hashes = tuple(range(8)) + tuple(
            hash((session, b)) for b in range(prompt_blocks - 8 + i // 32)
        )
        model.submit(
            SimRequest(
                f"r{i}", len(hashes) * 16 + 5, hashes, max_tokens=max_tokens, ignore_eos=True
            ),
            now,
        )
        if i % 8 == 7:
            now += model.step(now)
    while model.has_work:
        now += model.step(now)
    cpu = time.perf_counter() - t0
    s = model.stats
    hit = s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0
    print(
        f"[model] profile={profile.name} requests={requests} steps={s.steps} "
        f"cpu={cpu:.2f}s -> {requests / cpu:,.0f} req/s, {s.steps / cpu:,.0f} steps/s; "
        f"simulated {now:.1f}s, prefix hit {hit:.0%}"
    )


async def bench_http(args: argparse.Namespace) -> None:
    prompt = "You are a careful assistant for a routing gateway. " * (args.prompt_chars // 52 + 1)
    latencies: list[float] = []
    errors = 0
    tokens = 0
    async with SimCluster(args.replicas, args.profile, time_scale=args.time_scale) as cluster:
        urls = cluster.urls
        limits = httpx.Limits(
            max_connections=args.concurrency, max_keepalive_connections=args.concurrency
        )
        async with httpx.AsyncClient(limits=limits, timeout=60) as client:
            deadline = time.perf_counter() + args.duration

            async def worker(w: int) -> None:
                nonlocal errors, tokens
                i = 0
                while time.perf_counter() < deadline:
                    url = urls[(w + i) % len(urls)] + "/v1/chat/completions"
                    body = {
                        "model": "kvgate-sim",
                        "max_tokens": args.max_tokens,
                        "ignore_eos": True,
                        "messages": [{"role": "user", "content": f"{prompt} session {w} turn {i}"}],
                        "stream": args.stream,
                    }
                    t0 = time.perf_counter()
                    if args.stream:
                        async with client.stream("POST", url, json=body) as r:
                            async for _ in r.aiter_bytes():
                                pass
                            ok = r.status_code == 200
                    else:
                        r = await client.post(url, json=body)
                        ok = r.status_code == 200
                    latencies.append(time.perf_counter() - t0)
                    if ok:
                        tokens += args.max_tokens
                    else:
                        errors += 1
                    i += 1

            t_start = time.perf_counter()
            cpu0 = time.process_time()
            await asyncio.gather(*(worker(w) for w in range(args.concurrency)))
            wall = time.perf_counter() - t_start
            cpu = time.process_time() - cpu0
    n = len(latencies)
    q = statistics.quantiles(latencies, n=100) if n >= 2 else [0.0] * 99
    print(
        f"[http] replicas={args.replicas} profile={args.profile} time_scale={args.time_scale} "
        f"concurrency={args.concurrency} stream={args.stream} max_tokens={args.max_tokens}"
    )
    print(
        f"[http] {n} requests in {wall:.1f}s -> {n / wall:,.0f} req/s "
        f"({tokens / wall:,.0f} output tok/s), errors={errors}, "
        f"latency p50={q[49] * 1000:.1f}ms p99={q[98] * 1000:.1f}ms, "
        f"process CPU {cpu / wall:.0%} of one core (server + load generator), "
        f"{n / cpu if cpu else 0.0:,.0f} req per CPU-second"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--profile", default="instant", choices=sorted(PROFILES))
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt-chars", type=int, default=2000)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--model-requests", type=int, default=5000)
    args = parser.parse_args()
    bench_model(args.profile, args.model_requests, prompt_blocks=64, max_tokens=args.max_tokens)
    asyncio.run(bench_http(args))


if __name__ == "__main__":
    main()
