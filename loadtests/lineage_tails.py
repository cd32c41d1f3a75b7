"""Where the slow requests of a `bench_lineage.py --json` run went, by request kind.

bench_lineage's JSON keeps, per run and per request in trace order, the TTFT, the cached
prompt tokens and (kvgate only) the replica. This regenerates the run's shape trace (same
seed and window as the bench) and splits its requests by kind, from the session ids the
shape generator writes (gateway.trace.shapes):

  main1 / main+   a main session's first / later turns (agents, sampled or RAG sessions)
  resume          a main agent's first turn after its subagents forked
  child1 / child+ a subagent's first / later turns (session ``<parent>/<n>``)
  chat1 / chat+   the short chats mixed in

Per kind: requests, mean / p50 / p99 TTFT, hit rate, how many are at or above the run's
p95, and their uncached prompt tokens. With replicas known, the slowest requests follow,
each with the uncached prefill that was queued ahead of it on its replica (requests sent
there before it whose first token came after its arrival, from the replay's own arrivals
and TTFTs) against the least such queue on any other replica, in tokens and in seconds at
the engines' prefill speed. A tail whose queue ahead dwarfs the least queue elsewhere is
co-location; one whose queue is short is its own prefill.

    python loadtests/lineage_tails.py runs.json --trace forks [--router kvgate] [--slowest 20]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import struct
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

# Runnable from a checkout without installing: the repository root holds gateway/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_lineage as bench

from gateway.sim.profiles import get_profile
from gateway.trace.format import Trace, TraceRecord
from gateway.trace.shapes import ShapeOptions, generate_shape

KINDS = ("main1", "main+", "resume", "child1", "child+", "chat1", "chat+")


def kinds(records: Sequence[TraceRecord], mains: int, seed: int) -> list[str]:
    """The kind of each request, from the shape generator's session ids."""
    maker_ids = {main_session_id(seed, n) for n in range(mains)}
    seen: set[str] = set()
    forked: set[str] = set()
    out = []
    for r in records:
        sid = r.session_id or ""
        if "/" in sid:
            kind = "child1" if sid not in seen else "child+"
            forked.add(sid.split("/", 1)[0])
        elif sid in maker_ids:
            if sid not in seen:
                kind = "main1"
            elif sid in forked:
                kind = "resume"
                forked.discard(sid)
            else:
                kind = "main+"
        else:
            kind = "chat1" if sid not in seen else "chat+"
        seen.add(sid)
        out.append(kind)
    return out


def main_session_id(seed: int, n: int) -> str:
    """The n-th main session's id as gateway.trace.shapes writes it (`_Maker.sid`)."""
    return xxhash.xxh3_64_hexdigest(struct.pack("<QQ", seed & ((1 << 64) - 1), n))


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else math.nan


@dataclass(frozen=True)
class Request:
    kind: str
    arrival: float  # simulated seconds
    prompt: int
    cached: int
    ttft: float | None
    replica: str | None

    @property
    def uncached(self) -> int:
        return max(0, self.prompt - self.cached)


def requests_of(
    run: dict[str, Any], trace: Trace, kind_of: Sequence[str], speedup: float, time_scale: float
) -> list[Request]:
    return [
        Request(k, r.arrival_s / speedup * time_scale, r.input_tokens, c or 0, t, rep)
        for r, k, t, c, rep in zip(
            trace.records,
            kind_of,
            run["ttft_s"],
            run["cached"],
            run["replicas"] or [None] * len(trace.records),
            strict=True,
        )
    ]


def queued_ahead(reqs: Sequence[Request], i: int, replica: str | None) -> int:
    """Uncached prefill sent to `replica` before request i that had no first token yet."""
    at = reqs[i].arrival
    return sum(
        r.uncached
        for r in reqs[:i]
        if r.replica == replica and r.ttft is not None and r.arrival + r.ttft > at
    )


def report(reqs: Sequence[Request], rate: float, slowest: int) -> list[str]:
    lines = []
    done = [r.ttft for r in reqs if r.ttft is not None]
    p95 = percentile(done, 0.95)
    hit = sum(r.cached for r in reqs) / max(1, sum(r.prompt for r in reqs))
    lines.append(
        f"all {len(done)}: mean {statistics.fmean(done):.2f}  p99 {percentile(done, 0.99):.2f}"
        f"  hit {hit:.1%}"
    )
    lines.append(
        f"{'kind':8} {'n':>4} {'mean':>6} {'p50':>6} {'p99':>6} {'hit':>6} {'>=p95':>5}"
        f" {'uncached':>9}"
    )
    by: dict[str, list[Request]] = defaultdict(list)
    for r in reqs:
        if r.ttft is not None:
            by[r.kind].append(r)
    for kind in KINDS:
        group = by.get(kind)
        if not group:
            continue
        t = [r.ttft for r in group if r.ttft is not None]
        h = sum(r.cached for r in group) / max(1, sum(r.prompt for r in group))
        lines.append(
            f"{kind:8} {len(group):4d} {statistics.fmean(t):6.2f} {percentile(t, 0.5):6.2f}"
            f" {percentile(t, 0.99):6.2f} {h:6.1%} {sum(x >= p95 for x in t):5d}"
            f" {sum(r.uncached for r in group):9d}"
        )
    replicas = sorted({r.replica for r in reqs if r.replica is not None})
    if not replicas:
        return lines
    per: dict[str, int] = defaultdict(int)
    for r in reqs:
        if r.replica is not None:
            per[r.replica] += r.uncached
    mean = sum(per.values()) / len(per)
    lines.append(
        "uncached per replica (M tokens): "
        + " ".join(f"{k} {v / 1e6:.2f}" for k, v in sorted(per.items()))
        + f"  max/mean {max(per.values()) / mean:.2f}"
    )
    lines.append("slowest: index kind replica prompt cached ttft | queued ahead | least elsewhere")
    order = sorted(
        (i for i, r in enumerate(reqs) if r.ttft is not None), key=lambda i: -(reqs[i].ttft or 0)
    )
    for i in order[:slowest]:
        r = reqs[i]
        mine = queued_ahead(reqs, i, r.replica)
        least = min(queued_ahead(reqs, i, o) for o in replicas if o != r.replica)
        lines.append(
            f" {i:5d} {r.kind:7} {r.replica} {r.prompt:6d} {r.cached:6d} {r.ttft or 0:6.2f}"
            f" | {mine:7d} {mine / rate:5.1f}s | {least:7d} {least / rate:5.1f}s"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="a bench_lineage.py --json file")
    ap.add_argument("--trace", choices=bench.SHAPE_TRACES, required=True)
    ap.add_argument("--router", help="only runs of this router")
    ap.add_argument("--slowest", type=int, default=15, help="slowest requests to list")
    args = ap.parse_args(argv)
    dump = json.loads(Path(args.json).read_text())
    a = dump["args"]
    d = bench.TRACE_DEFAULTS[args.trace]
    requests = a.get("requests") or d.requests
    shape = ShapeOptions(
        shape=args.trace,
        seed=a.get("agent_seed", 1),
        sessions=bench.SHAPE_SESSIONS,
        duration_s=bench.SHAPE_DURATION_S,
    )
    trace, _ = bench.fitting(
        generate_shape(shape).window(0, requests), a["blocks"], a["max_output_tokens"]
    )
    kind_of = kinds(trace.records, bench.SHAPE_SESSIONS, shape.seed)
    speedup = a.get("speedup") or d.speedup
    time_scale = a.get("time_scale") or d.time_scale
    rate = get_profile(bench.ENGINE_PROFILE).prefill_tokens_per_s * a.get("prefill_speed", 1.0)
    for run in dump["runs"]:
        if run.get("skipped") or (args.router and run["router"] != args.router):
            continue
        if not run["ttft_s"] or len(run["ttft_s"]) != len(trace.records):
            print(f"\n{run['router']}: not a run of this trace window")
            continue
        print(f"\n== {run['router']}, {run['cell']}, run {run['repeat'] + 1}")
        reqs = requests_of(run, trace, kind_of, speedup, time_scale)
        print("\n".join(report(reqs, rate, args.slowest)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
