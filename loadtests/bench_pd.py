"""Prefill/decode hand-off: colocated-only vs PD always vs PD auto, on simulated engines.

Four simulated engines sit behind a real gateway in every run. Colocated-only deploys them
as four `both` replicas; the PD runs as one prefill and three decode replicas (vLLM
connector protocol; decode replicas also serve whole requests, see PDSettings.serves_whole),
with `pd.mode` `always` or `auto`. Two model profiles and workloads:

* dense: `h200-dense` (320 KiB of KV per token). Many decode-heavy streams (short prompt,
  128 output tokens) plus open-loop long *uncached* prompts (6K tokens, fresh documents).
  A long prefill on a colocated replica stalls every stream decoding there.
* small-kv: `h200-sparse` (70 KB per token, sparse attention). The same decode streams plus
  sticky agent sessions: a 6K-token context growing ~250 tokens a turn, so most of each
  prompt is cached on the session's replica; `auto` should stay colocated almost always.

Figures (latencies in simulated milliseconds: wall time x --time-scale): decode
inter-token latency p50/p99 over the decode-heavy streams, TTFT p99 over all requests and
over the long ones, total-token throughput (prompt + completion tokens per simulated
second), KV bytes moved between engines, and the share of requests PD split.

    python loadtests/bench_pd.py [--seconds 25] [--time-scale 1] [--profiles dense small-kv]
"""

from __future__ import annotations

import argparse
import asyncio
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

from gateway.app import build_app
from gateway.serving import start_server
from gateway.settings import KvgateSettings
from gateway.sim.cluster import SimCluster
from gateway.sim.profiles import get_profile
from gateway.types import Role

MODEL = "pd-bench"
PROFILES = {"dense": "h200-dense", "small-kv": "h200-sparse"}
MODES = ("colocated-only", "pd-always", "pd-auto")
TOPOLOGY = {
    "colocated-only": [Role.BOTH] * 4,
    "pd-always": [Role.PREFILL, Role.DECODE, Role.DECODE, Role.DECODE],
    "pd-auto": [Role.PREFILL, Role.DECODE, Role.DECODE, Role.DECODE],
}
WORDS = tuple(f"w{i:x}" for i in range(4096))


def text(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of fresh text (the sim counts ~4 characters a token)."""
    out = " ".join(rng.choices(WORDS, k=tokens))
    return out[: tokens * 4]


@dataclass
class Sample:
    kind: str  # "decode" | "long"
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0  # prompt + completion, from usage
    replica: str = ""
    ok: bool = False


@dataclass
class Result:
    profile: str
    mode: str
    samples: list[Sample]
    wall_s: float
    bytes_moved: int
    split: float
    decided: float

    def row(self, scale: float) -> list[str]:
        gaps = [g for s in self.samples if s.kind == "decode" for g in s.gaps]
        ttft = [s.ttft for s in self.samples if s.ttft is not None]
        long_ttft = [s.ttft for s in self.samples if s.kind == "long" and s.ttft is not None]
        tokens = sum(s.tokens for s in self.samples)
        failed = sum(not s.ok for s in self.samples)
        ms = 1000.0 * scale
        return [
            self.profile,
            self.mode,
            f"{len(self.samples)}" + (f" ({failed} failed)" if failed else ""),
            f"{pct(gaps, 50) * ms:.0f}",
            f"{pct(gaps, 99) * ms:.0f}",
            f"{pct(ttft, 99) * ms:.0f}",
            f"{pct(long_ttft, 99) * ms:.0f}",
            f"{tokens / (self.wall_s * scale):,.0f}",
            f"{self.bytes_moved / 1e9:.2f}",
            f"{100 * self.split / self.decided:.0f}%" if self.decided else "-",
        ]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def stream_one(
    http: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str], sample: Sample
) -> str:
    """Send one streaming chat request; fill `sample`; return the answer text."""
    start = time.perf_counter()
    last: float | None = None
    answer: list[str] = []
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        sample.replica = resp.headers.get("x-kvgate-replica", "")
        if resp.status_code != 200:
            await resp.aread()
            return ""
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            if event.get("usage"):
                sample.tokens = event["usage"]["total_tokens"]
            for choice in event.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if not piece:
                    continue
                now = time.perf_counter()
                if last is None:
                    sample.ttft = now - start
                else:
                    sample.gaps.append(now - last)
                last = now
                answer.append(piece)
    sample.ok = True
    return "".join(answer)


def chat(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def decode_worker(
    http: httpx.AsyncClient, rng: random.Random, stop: float, out: list[Sample], worker: int
) -> None:
    n = 0
    while time.perf_counter() < stop:
        sample = Sample("decode")
        out.append(sample)
        msgs = [{"role": "user", "content": f"task {worker}-{n}: " + text(rng, 200)}]
        await stream_one(http, chat(msgs, 128), {"X-Session-Id": f"d{worker}-{n}"}, sample)
        n += 1


async def fresh_long_prompts(
    http: httpx.AsyncClient,
    rng: random.Random,
    stop: float,
    out: list[Sample],
    rate: float,
    tokens: int,
    scale: float,
) -> None:
    """Open-loop arrivals of long prompts nobody has seen before."""
    tasks: set[asyncio.Task[str]] = set()
    n = 0
    while True:
        await asyncio.sleep(rng.expovariate(rate * scale))
        if time.perf_counter() >= stop:
            break
        sample = Sample("long")
        out.append(sample)
        msgs = [{"role": "user", "content": f"document {n}: " + text(rng, tokens)}]
        task = asyncio.create_task(
            stream_one(http, chat(msgs, 16), {"X-Session-Id": f"l{n}"}, sample)
        )
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        n += 1
    if tasks:
        await asyncio.gather(*tasks)


async def agent_session(
    http: httpx.AsyncClient,
    rng: random.Random,
    stop: float,
    out: list[Sample],
    worker: int,
    context: int,
    turns: int,
) -> None:
    """Sticky multi-turn sessions: a long context that grows a little every turn."""
    session = 0
    while time.perf_counter() < stop:
        key = f"a{worker}-{session}"
        msgs = [{"role": "system", "content": f"agent {key}: " + text(rng, context)}]
        for _ in range(turns):
            if time.perf_counter() >= stop:
                return
            msgs.append({"role": "user", "content": text(rng, 250)})
            sample = Sample("long")
            out.append(sample)
            answer = await stream_one(http, chat(msgs, 24), {"X-Session-Id": key}, sample)
            msgs.append({"role": "assistant", "content": answer})
        session += 1


async def run(profile_key: str, mode: str, args: argparse.Namespace) -> Result:
    profile = get_profile(PROFILES[profile_key])
    roles = TOPOLOGY[mode]
    scale = args.time_scale
    pd: dict[str, Any] = {}
    if mode != "colocated-only":
        pd = {
            "models": {
                MODEL: {
                    "mode": "always" if mode == "pd-always" else "auto",
                    "kv_bytes_per_token": profile.kv_bytes_per_token,
                    "link_gbps": profile.link_bytes_per_s * 8 / 1e9,
                    "min_uncached_tokens": args.min_uncached,
                    "max_transfer_ms": args.max_transfer_ms,
                }
            }
        }
    async with SimCluster(
        len(roles), profile, model=MODEL, roles=roles, time_scale=scale, seed=args.seed
    ) as sim:
        settings = KvgateSettings(
            replicas=[
                {"id": f"{r.value[0]}{i}", "url": url, "role": r.value, "models": [MODEL]}
                for i, (url, r) in enumerate(zip(sim.urls, roles, strict=True))
            ],
            routing={"policy": "prefix_affinity"},
            health={"enabled": False},
            models={"discover": False},
            pd=pd,
        )
        app = build_app(settings)
        server = await start_server(app)
        state = app.state.gateway
        samples: list[Sample] = []
        rng = random.Random(args.seed)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as http:
                t0 = time.perf_counter()
                stop = t0 + args.seconds
                jobs = [
                    decode_worker(http, random.Random(rng.random()), stop, samples, i)
                    for i in range(args.decode_streams)
                ]
                if profile_key == "dense":
                    jobs.append(
                        fresh_long_prompts(
                            http,
                            random.Random(rng.random()),
                            stop,
                            samples,
                            args.long_rate,
                            args.long_tokens,
                            scale,
                        )
                    )
                else:
                    jobs += [
                        agent_session(
                            http,
                            random.Random(rng.random()),
                            stop,
                            samples,
                            i,
                            args.long_tokens,
                            args.turns,
                        )
                        for i in range(args.sessions)
                    ]
                await asyncio.gather(*jobs)
                wall = time.perf_counter() - t0
        finally:
            await server.stop()
        registry = state.metrics.registry
        split = decided = 0.0
        for metric in registry.collect():
            if metric.name == "kvgate_pd_decisions":
                for s in metric.samples:
                    if s.name.endswith("_total"):
                        decided += s.value
                        split += s.value if s.labels["decision"] == "disaggregate" else 0.0
        moved = sum(e.model.stats.kv_rx_bytes for e in sim.engines)
    return Result(profile_key, mode, samples, wall, moved, split, decided)


HEADER = [
    "profile",
    "mode",
    "requests",
    "ITL p50 ms",
    "ITL p99 ms",
    "TTFT p99 ms",
    "long TTFT p99 ms",
    "tokens/s",
    "GB moved",
    "split",
]


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    lines = [" | ".join(h.ljust(w) for h, w in zip(HEADER, widths, strict=True))]
    lines.append("-|-".join("-" * w for w in widths))
    lines += [" | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=25.0, help="wall seconds per run")
    parser.add_argument("--time-scale", type=float, default=1.0, help="sim speed-up")
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=list(PROFILES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--decode-streams", type=int, default=12)
    parser.add_argument("--long-rate", type=float, default=0.5, help="long prompts / sim s")
    parser.add_argument("--long-tokens", type=int, default=6000)
    parser.add_argument("--sessions", type=int, default=6, help="agent sessions (small-kv)")
    parser.add_argument("--turns", type=int, default=12, help="turns per agent session")
    parser.add_argument("--min-uncached", type=int, default=2048)
    parser.add_argument("--max-transfer-ms", type=float, default=50.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rows = []
    for profile in args.profiles:
        for mode in args.modes:
            result = await run(profile, mode, args)
            rows.append(result.row(args.time_scale))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(table(rows))


if __name__ == "__main__":
    asyncio.run(main())
