"""Cost of the shared store: kvgate with `store.backend` memory vs redis (vs redis down).

Processes: the `instant` simulated engine (`kvgate sim`), a redis-server on a free port,
one gateway per backend (`kvgate serve`), and the load generator of bench_overhead.py in
its own process. Two session patterns:

* ``reuse``: each client cycles over 8 sessions, so after the first turn the placement is
  known locally and the request path makes no Redis call (the common case);
* ``unique``: every request is a new session, so each one pays the one pipelined lookup
  (the worst case), and the assignment is written in the background.

    python loadtests/bench_store.py                       # ~4 s per cell
    python loadtests/bench_store.py --duration 2 --levels 1,32

It prints req/s, p50/p99 latency, the added p50 against the memory backend and the gateway
CPU per request. "redis-down" points the gateway at a port nobody listens on: requests
are served from local state (degraded), which must cost nothing extra.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_overhead import MODEL, ROOT, Proc, cpu_seconds, free_port, start_gateway, wait_ready

sys.path.insert(0, str(ROOT))


async def _loadgen(
    url: str, concurrency: int, duration: float, warmup: float, unique: bool
) -> dict[str, Any]:
    import aiohttp

    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 8}
    ).encode()
    latencies: list[float] = []
    errors = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency * 2)) as http:
        start = time.perf_counter()
        measure_from, stop_at = start + warmup, start + warmup + duration

        async def worker(i: int) -> None:
            nonlocal errors
            n = 0
            while (t0 := time.perf_counter()) < stop_at:
                n += 1
                session = f"w{i}-{n}" if unique else f"w{i}-{n % 8}"
                try:
                    async with http.post(
                        url,
                        data=body,
                        headers={"content-type": "application/json", "x-session-id": session},
                    ) as resp:
                        await resp.read()
                        ok = resp.status == 200
                except aiohttp.ClientError:
                    ok = False
                if t0 < measure_from:
                    continue
                if ok:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    latencies.sort()

    def pct(q: float) -> float:
        return (
            latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000
            if latencies
            else float("nan")
        )

    return {
        "requests": len(latencies),
        "errors": errors,
        "rps": len(latencies) / duration,
        "p50_ms": pct(0.5),
        "p99_ms": pct(0.99),
    }


def run_loadgen(
    url: str, concurrency: int, duration: float, warmup: float, unique: bool
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--loadgen",
        url,
        "--concurrency",
        str(concurrency),
        "--duration",
        str(duration),
        "--warmup",
        str(warmup),
    ] + (["--unique"] if unique else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


async def _micro(redis_url: str, n: int) -> list[tuple[str, float]]:
    """Per-call cost of the request-path verbs, in-process (less noisy than HTTP)."""
    from gateway.store import MemoryStore, StoreSettings
    from gateway.store.redis import RedisStore
    from gateway.types import ReplicaId, SessionKey

    out: list[tuple[str, float]] = []
    redis_store = RedisStore(StoreSettings(backend="redis", url=redis_url, key_prefix="bench"))
    await redis_store.start()
    try:
        for name, store in (("memory", MemoryStore()), ("redis", redis_store)):
            keys = [SessionKey(f"{name}-{i}") for i in range(n)]
            t0 = time.perf_counter()
            for k in keys:
                await store.lookup_session(k)  # miss: redis pays one round trip each
            t1 = time.perf_counter()
            for k in keys:
                await store.assign_session(k, ReplicaId("r1"))
            t2 = time.perf_counter()
            for k in keys:
                await store.lookup_session(k)  # known locally
            t3 = time.perf_counter()
            await store.sync()
            out += [
                (f"{name} lookup miss", (t1 - t0) / n),
                (f"{name} assign", (t2 - t1) / n),
                (f"{name} lookup hit", (t3 - t2) / n),
            ]
    finally:
        await redis_store.close()
    return out


def wait_redis(port: int, timeout: float = 10.0) -> None:
    import redis

    client = redis.Redis(port=port, socket_connect_timeout=0.2)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    finally:
        client.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--loadgen", help=argparse.SUPPRESS)
    parser.add_argument("--unique", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds measured per cell")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds discarded per cell")
    parser.add_argument("--levels", default="1,32", help="concurrency levels")
    args = parser.parse_args()
    if args.loadgen:
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        print(
            json.dumps(
                asyncio.run(
                    _loadgen(
                        args.loadgen, args.concurrency, args.duration, args.warmup, args.unique
                    )
                )
            )
        )
        return 0

    binary = shutil.which("redis-server")
    if binary is None:
        print("redis-server not found on PATH", file=sys.stderr)
        return 2
    levels = [int(x) for x in args.levels.split(",")]
    redis_port, dead_port, engine_port = free_port(), free_port(), free_port()
    redis = Proc(
        [
            binary,
            "--port",
            str(redis_port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
    )
    engine = Proc(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "sim",
            "--profile",
            "instant",
            "--port",
            str(engine_port),
        ]
    )
    backends = {
        "memory": "store:\n  backend: memory\n",
        "redis": f"store:\n  backend: redis\n  url: redis://127.0.0.1:{redis_port}/0\n",
        "redis-down": f"store:\n  backend: redis\n  url: redis://127.0.0.1:{dead_port}/0\n",
    }
    rows: list[dict[str, Any]] = []
    try:
        wait_ready(f"http://127.0.0.1:{engine_port}/health")
        wait_redis(redis_port)
        micro = asyncio.run(_micro(f"redis://127.0.0.1:{redis_port}/0", 2000))
        base: dict[tuple[int, bool], dict[str, Any]] = {}
        for name, store in backends.items():
            gw, url = start_gateway(f"http://127.0.0.1:{engine_port}", "aiohttp", store, "error")
            try:
                for unique in (False, True):
                    for c in levels:
                        cpu0 = cpu_seconds(gw.p.pid)
                        r = run_loadgen(
                            url + "/v1/chat/completions", c, args.duration, args.warmup, unique
                        )
                        cpu1 = cpu_seconds(gw.p.pid)
                        if cpu0 is not None and cpu1 is not None:
                            total = r["requests"] * (args.duration + args.warmup) / args.duration
                            r["gw_cpu_us"] = (cpu1 - cpu0) / max(1.0, total) * 1e6
                        if name == "memory":
                            base[(c, unique)] = r
                        ref = base[(c, unique)]
                        r["ratio"] = r["rps"] / ref["rps"] if ref["rps"] else float("nan")
                        r["added_p50_ms"] = r["p50_ms"] - ref["p50_ms"]
                        rows.append(
                            {
                                "store": name,
                                "sessions": "unique" if unique else "reuse",
                                "conc": c,
                                **r,
                            }
                        )
            finally:
                gw.stop()
    finally:
        engine.stop()
        redis.stop()

    print(
        f"{'store':10} {'sessions':8} {'conc':>4} {'req/s':>8} {'p50ms':>7} {'p99ms':>7} {'err':>4} "
        f"{'vs mem':>6} {'+p50ms':>7} {'gwCPUus':>8}"
    )
    for r in rows:
        print(
            f"{r['store']:10} {r['sessions']:8} {r['conc']:>4} {r['rps']:>8.0f} {r['p50_ms']:>7.2f} "
            f"{r['p99_ms']:>7.2f} {r['errors']:>4} {r['ratio']:>6.2f} {r['added_p50_ms']:>7.2f} "
            f"{r.get('gw_cpu_us', float('nan')):>8.0f}"
        )
    print(
        "vs mem / +p50ms: against the memory backend in the same row group; gwCPUus: gateway CPU per request."
    )
    print("request-path verbs, in-process, sequential (one await at a time):")
    for label, seconds in micro:
        print(f"  {label:20} {seconds * 1e6:8.1f} us/call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
