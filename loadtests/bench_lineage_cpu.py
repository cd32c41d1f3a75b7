"""CPU the gateway spends per 100K-token request to hash the prompt and find its lineage.

Builds agent conversations of about `--tokens` tokens (a shared preamble, then turns of
tool results and answers), in both message layouts and as a completions prompt, and
times, per request, in this process (no HTTP, no JSON parse):

* `hash`: `gateway.keys.route_request` with the default session settings (the whole
  prompt in 256-token blocks) and the lineage lookup it calls;
* `record`: entering the served prompt in the lineage index;
* `placed`: the default policy's own bookkeeping once the request was sent (its prefix
  index and live-session table).

The figures are medians over the last 3 turns of 8 interleaved conversations of one
preamble, whose prompts are then about `--tokens` long; with `--repeat N` the whole run is
done N times and each column prints the median of the N medians, then their min..max.
Times are this thread's CPU time (`--clock cpu`, the default: what the gateway's event loop
spends; a wall clock on a shared VM also counts the host's preemptions) or the wall clock
(`--clock wall`).

    python loadtests/bench_lineage_cpu.py [--tokens 100000 --turns 30 --repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.allocator import tune_allocator
from gateway.keys import route_request
from gateway.lineage import Conversations
from gateway.policy import PolicyContext
from gateway.routing import RoutingSettings, build_router
from gateway.settings import SessionSettings
from gateway.types import Endpoint, ReplicaId, ReplicaState

PREAMBLE = "You are a coding agent. Tools:\n" + "".join(
    f"- tool_{i}(path: str, query: str) -> JSON: reads, searches and edits files.\n"
    for i in range(280)
)  # ~20K tokens


def body(layout: str, history: list[str]) -> tuple[dict[str, Any], Endpoint]:
    if layout == "completions":
        return {"model": "m", "prompt": PREAMBLE + "".join(history)}, Endpoint.COMPLETIONS
    if layout == "growing":
        messages = [
            {"role": "system", "content": "Be an agent."},
            {"role": "user", "content": PREAMBLE + "\n".join(history)},
        ]
    else:
        messages = [{"role": "system", "content": PREAMBLE}] + [
            {"role": "user" if i % 2 == 0 else "assistant", "content": text}
            for i, text in enumerate(history)
        ]
    return {"model": "m", "messages": messages}, Endpoint.CHAT


CLOCK = time.thread_time_ns


def run(layout: str, tokens: int, turns: int, sessions: int) -> dict[str, float]:
    cfg = SessionSettings()
    convs = Conversations(cfg.block_tokens)
    replicas = tuple(
        ReplicaState(ReplicaId(f"r{i}"), f"http://r{i}", kv_capacity_tokens=4_000_000)
        for i in range(8)
    )
    router = build_router(RoutingSettings(), PolicyContext(replicas=replicas))
    per_turn = max(64, (4 * tokens - len(PREAMBLE)) // turns)
    histories = [[f"Task {s}: fix the failing test in module {s}.\n"] for s in range(sessions)]
    times: dict[str, list[float]] = {"hash": [], "record": [], "both": [], "placed": []}
    sizes: list[int] = []
    for turn in range(turns):
        for s, history in enumerate(histories):
            b, endpoint = body(layout, history)
            t0 = CLOCK()
            request = route_request(
                b,
                endpoint,
                f"q{turn}-{s}",
                block_tokens=cfg.block_tokens,
                max_prefix_blocks=cfg.max_prefix_blocks,
                lineage=convs.key_for,
            )
            t1 = CLOCK()
            convs.record(request.lineage_hashes, request.session_key, request.lineage_tail)
            t2 = CLOCK()
            replica = replicas[s % 8].id
            router.dispatched(request, replica)  # type: ignore[attr-defined]
            router.placed(request, replica)  # type: ignore[attr-defined]
            router.prefilled(request)  # type: ignore[attr-defined]
            t3 = CLOCK()
            if turn >= turns - 3:  # the last turns: prompts of about `tokens`
                times["hash"].append((t1 - t0) / 1e3)
                times["record"].append((t2 - t1) / 1e3)
                times["both"].append((t2 - t0) / 1e3)
                times["placed"].append((t3 - t2) / 1e3)
                sizes.append(request.prompt_tokens)
            history.append(f"Tool result {turn}: " + "x" * per_turn + "\n")
    out = {k: statistics.median(v) for k, v in times.items()}
    out["tokens"] = statistics.median(sizes)
    out["lineages"] = float(convs.index.lineages)
    return out


def _cell(values: list[float]) -> str:
    mid = statistics.median(values)
    if len(values) == 1:
        return f"{mid:.1f}"
    return f"{mid:.1f} ({min(values):.0f}..{max(values):.0f})"


def main() -> None:
    global CLOCK
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000, help="size of the last turn")
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=1, help="whole runs (median, min..max)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument(
        "--default-allocator",
        action="store_true",
        help="leave glibc's allocator as it is (kvgate serve tunes it: gateway.allocator)",
    )
    args = ap.parse_args()
    CLOCK = time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns
    tuned = False if args.default_allocator else tune_allocator()
    print(f"allocator tuned as kvgate serve does: {'yes' if tuned else 'no'}")
    print(f"clock: {args.clock}; runs: {args.repeat}")
    cols = ("hash", "record", "both", "placed")
    print(f"{'layout':12} {'tokens':>7} " + " ".join(f"{c + ' us':>18}" for c in cols))
    for layout in ("turns", "growing", "completions"):
        runs = [run(layout, args.tokens, args.turns, args.sessions) for _ in range(args.repeat)]
        cells = " ".join(f"{_cell([r[c] for r in runs]):>18}" for c in cols)
        print(f"{layout:12} {runs[0]['tokens']:>7.0f} {cells}")
    print(
        "Medians over the last 3 turns of each conversation. hash: route_request incl. "
        "the lineage lookup; record: the lineage index; both: hash + record per request "
        "(the 150 us budget); placed: the default policy's bookkeeping (prefix index, "
        "live sessions, prefill count)."
    )


if __name__ == "__main__":
    main()
