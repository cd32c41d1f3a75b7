"""What any router could reach on bench_lineage's traces, and how far runs are.

Offline, from the trace's block hashes (no engines, seconds), for any trace
bench_lineage.py replays (`--traces`: `synthetic`, the Mooncake window, 512-token blocks;
`agent`, `forks`, `samples`, `rag`, generated as bench_lineage generates them, `--agent-seed`):

* `infinite`: every block ever seen is still cached somewhere (no router does better);
* `pooled LRU`: one LRU cache holding all the engines' KV; the engines evict by LRU, but
  this is *not* a bound: a router that keeps one-off prompts away from reused ones can
  beat it;
* `pooled OPT`: the same pooled cache evicting the block used farthest in the future
  (Belady, with bypass). Still not reachable (engines evict by LRU, each its own cache),
  but a router's hit rate cannot exceed it.

Hit rates are token-weighted leading-prefix hits, as the engines count them. With `--runs
FILE` (a `bench_lineage.py --json` file of the same window), each run's placement is also
read: `placed inf` is its hit rate had every engine an infinite cache (what the placement
alone loses: a prompt sent away from the replica holding its prefix), `sent away` counts
requests with a prefix cached somewhere sent to a replica holding less of it, `copies` the
requests whose longest prefix was then held by two replicas or more.

    python loadtests/bench_bounds.py --blocks 16000
    python loadtests/bench_bounds.py --blocks 16000 --runs out.json
    python loadtests/bench_bounds.py --traces agent,forks,samples,rag --runs out.json

Issue 45 judges the agent shapes by the `infinite` line: a router's hit rate at least 99% of
it. The bound counts whole blocks of the trace, and the engines cache 16-token blocks, so on
a trace with long blocks a router can pass it by a fraction of a block per request.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_lineage
from bench_lineage import REPLICAS

from gateway.trace.format import TraceRecord

ENGINE_BLOCK_TOKENS = 16


def prefix_hit(records: Sequence[TraceRecord], hits: Sequence[set[int]], block: int) -> float:
    """Token-weighted hit rate when request i found the blocks at positions `hits[i]`:
    only the leading run counts, as in an engine's prefix cache."""
    total = hit = 0
    for r, held in zip(records, hits, strict=True):
        total += r.input_tokens
        depth = 0
        while depth in held:
            depth += 1
        hit += min(depth * block, r.input_tokens)
    return hit / total if total else 0.0


def infinite(records: Sequence[TraceRecord]) -> list[set[int]]:
    seen: set[int] = set()
    hits = []
    for r in records:
        hits.append({j for j, h in enumerate(r.block_hashes) if h in seen})
        seen.update(r.block_hashes)
    return hits


def pooled_lru(records: Sequence[TraceRecord], capacity: int) -> list[set[int]]:
    lru: collections.OrderedDict[int, None] = collections.OrderedDict()
    hits = []
    for r in records:
        hits.append({j for j, h in enumerate(r.block_hashes) if h in lru})
        for h in reversed(r.block_hashes):  # deepest first: tails are evicted first
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > capacity:
            lru.popitem(last=False)
    return hits


def pooled_opt(records: Sequence[TraceRecord], capacity: int) -> list[set[int]]:
    refs = [(i, j, h) for i, r in enumerate(records) for j, h in enumerate(r.block_hashes)]
    never = len(refs) + 1
    following = [never] * len(refs)
    last: dict[int, int] = {}
    for k in range(len(refs) - 1, -1, -1):
        h = refs[k][2]
        following[k] = last.get(h, never)
        last[h] = k
    cache: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block), stale entries skipped
    hits: list[set[int]] = [set() for _ in records]
    for k, (i, j, h) in enumerate(refs):
        if h in cache:
            hits[i].add(j)
        cache[h] = following[k]
        heapq.heappush(heap, (-following[k], h))
        while len(cache) > capacity:
            use, victim = heapq.heappop(heap)
            if cache.get(victim) == -use:
                del cache[victim]
    return hits


def placement(records: Sequence[TraceRecord], replicas: Sequence[str], block: int) -> dict:
    held: dict[str, set[int]] = collections.defaultdict(set)
    everywhere: set[int] = set()
    hits = []
    away = copies = 0

    def depth(blocks: set[int], hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    for r, rep in zip(records, replicas, strict=True):
        hashes = r.block_hashes
        best = depth(everywhere, hashes)
        mine = depth(held[rep], hashes)
        if best and mine < best:
            away += 1
        if best and sum(1 for s in held.values() if depth(s, hashes) == best) > 1:
            copies += 1
        hits.append(set(range(mine)))
        held[rep].update(hashes)
        everywhere.update(hashes)
    return {"placed_inf": prefix_hit(records, hits, block), "away": away, "copies": copies}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--traces", default="synthetic", help="comma-separated, as bench_lineage's")
    ap.add_argument("--trace", default=str(bench_lineage.TRACE))
    ap.add_argument("--start", type=int, default=2993)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--agent-seed", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=32000, help="KV blocks of 16 tokens per engine")
    ap.add_argument("--max-output-tokens", type=int, default=1024)
    ap.add_argument("--runs", help="a bench_lineage.py --json file of the same traces")
    args = ap.parse_args()
    runs = json.loads(Path(args.runs).read_text())["runs"] if args.runs else []
    for name in args.traces.split(","):
        if name not in bench_lineage.TRACES + bench_lineage.SHAPE_TRACES:
            ap.error(f"unknown trace {name!r}")
        if bounds(name, args, [r for r in runs if r["cell"].split(" / ")[0] == name]):
            return 1
    return 0


def bounds(name: str, args: argparse.Namespace, runs: list[dict]) -> bool:
    """Print one trace's bounds and its runs' placements; True if it could not be loaded."""
    loaded = bench_lineage.load_workload(
        name,
        argparse.Namespace(
            trace=args.trace,
            start=args.start,
            requests=args.requests,
            blocks=args.blocks,
            max_output_tokens=args.max_output_tokens,
            speedup=None,
            time_scale=None,
            agent_trace=None,
            agent_seed=args.agent_seed,
            agent_sessions=bench_lineage.AGENT_SESSIONS,
            agent_duration=bench_lineage.AGENT_DURATION_S,
            prefill_speed=1.0,
        ),
    )
    if isinstance(loaded, str):
        print(f"{name}: {loaded}")
        return True
    records = loaded.trace.records
    block = loaded.trace.block_tokens
    capacity = REPLICAS * args.blocks * ENGINE_BLOCK_TOKENS // block
    print(
        f"{name}: {len(records)} requests, {REPLICAS} engines x "
        f"{args.blocks * ENGINE_BLOCK_TOKENS:,} KV tokens = {capacity:,} blocks of {block} tokens pooled"
    )
    print(f"  infinite    {prefix_hit(records, infinite(records), block):.1%}")
    print(f"  pooled LRU  {prefix_hit(records, pooled_lru(records, capacity), block):.1%}")
    print(f"  pooled OPT  {prefix_hit(records, pooled_opt(records, capacity), block):.1%}")
    if runs:
        print(f"{'run':34} {'hit':>6} {'placed inf':>10} {'sent away':>9} {'copies':>6}")
        for run in runs:
            served = run.get("replicas") or ()
            if run.get("skipped") or len(served) != len(records) or None in served:
                continue  # a router that does not name the replica (only kvgate does)
            p = placement(records, run["replicas"], block)
            name = f"{run['router']} #{run['repeat'] + 1} ({run['cell'].split(' / ')[1]})"
            print(
                f"{name:34} {run['figures']['hit']:6.1%} {p['placed_inf']:10.1%} "
                f"{p['away']:9d} {p['copies']:6d}"
            )
    return False


if __name__ == "__main__":
    raise SystemExit(main())
