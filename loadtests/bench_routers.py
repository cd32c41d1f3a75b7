"""kvgate next to the Rust routers (SGLang's and vLLM's), on the same engine and machine.

One `instant` simulated engine, and in front of it, each in its own process: kvgate
(default config, h1 upstream client), SGLang's router (`sglang-router`) and vLLM's router
(`vllm-router`). The load generator of bench_overhead.py drives the engine directly and
then each router, in alternating rounds, and prints per router: requests/s, p50/p99, the
added p50 (median over rounds of router p50 minus that round's direct p50), the
throughput ratio to direct, and the router's CPU per request (user+system of its whole
process tree) with its ratio to the cheapest Rust router's.

The Rust routers are not dependencies of kvgate. Install them apart, for example:

    python -m venv /tmp/routers && /tmp/routers/bin/pip install sglang-router vllm-router
    python loadtests/bench_routers.py --router-bin /tmp/routers/bin

A router that cannot be found or does not start is reported as skipped; kvgate always runs.
`floor` (loadtests/floor_app.py) is kvgate's server and upstream client alone, forwarding
with no gateway work: kvgate's CPU over the floor's is what its own request path costs.
`--baseline DIR` runs a second kvgate from another checkout (`base`) in the same rounds, for
a before/after on one machine. `--variant NAME=FILE` runs one more kvgate from this checkout
with FILE's YAML sections added to its config (say, features turned off), in the same rounds
too. Each of these is then set against `kvgate` round by round (CPU per request over
kvgate's in the same round: median and range), which the machine's load moves far less
than the absolute figures. After the table, kvgate's figures are set against those of the
previous release, read from the table in docs/scale.md that follows `PREVIOUS_MARKER`.
Policies: kvgate's default (consistent hash, bounded load), `--sglang-policy` (default
cache_aware, that router's own default) and `--vllm-policy` (default consistent_hash, the
closest to kvgate's).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench_overhead import (
    MODEL,
    Proc,
    agent_messages,
    free_port,
    median_row,
    run_loadgen,
    start_gateway,
    wait_ready,
)

ROUTERS = ("kvgate", "sglang", "vllm", "floor")
PREVIOUS_DOC = Path(__file__).resolve().parents[1] / "docs" / "scale.md"
PREVIOUS_MARKER = "<!-- bench_routers: previous release -->"


def previous_release(
    path: Path = PREVIOUS_DOC,
) -> tuple[str, dict[tuple[bool, int], dict[str, float]]]:
    """(release, {(stream, clients): figures}) from the table after PREVIOUS_MARKER in
    `path`; columns: release, mode (plain/stream), clients, CPU us, xRust, +p50 ms, ratio."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return "", {}
    if PREVIOUS_MARKER not in lines:
        return "", {}
    release, cells = "", {}
    for line in lines[lines.index(PREVIOUS_MARKER) + 1 :]:
        if not line.startswith("|"):
            if cells:
                break
            continue
        cols = [c.strip() for c in line.strip("|").split("|")]
        if len(cols) < 7 or cols[1] not in ("plain", "stream"):
            continue  # the header and its rule
        release = cols[0]
        cells[(cols[1] == "stream", int(cols[2]))] = {
            "cpu": float(cols[3]),
            "xrust": float(cols[4]),
            "added": float(cols[5]),
            "ratio": float(cols[6]),
        }
    return release, cells


def tree_cpu_seconds(pid: int) -> float | None:
    """User+system CPU of `pid` and its live descendants (a router may run helpers)."""
    tck = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry.name)] = int(fields[1])
        cpu[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tck
    if pid not in cpu:
        return None
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu.get(p, 0.0)
        todo.extend(child for child, par in parent.items() if par == p)
    return total


def answers_chat(url: str, timeout: float) -> str | None:
    """None once a chat completion through `url` succeeds within `timeout` s, else the last error."""
    body = json.dumps({"model": MODEL, "messages": agent_messages(0), "max_tokens": 2}).encode()
    deadline = time.monotonic() + timeout
    error = "no attempt"
    while time.monotonic() < deadline:
        request = urllib.request.Request(
            url + "/v1/chat/completions", data=body, headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=2) as resp:
                resp.read()
                return None
        except (OSError, http.client.HTTPException) as exc:  # URLError, resets, bad replies
            error = repr(exc)
            time.sleep(0.2)
    return error


def start_floor(args: argparse.Namespace, engine_url: str) -> tuple[Proc, str] | str:
    """loadtests/floor_app.py: kvgate's server and upstream client with no gateway around them."""
    port = free_port()
    script = Path(__file__).resolve().parent / "floor_app.py"
    proc = Proc([sys.executable, str(script), str(port)], env={"FLOOR_ENGINE": engine_url})
    url = f"http://127.0.0.1:{port}"
    error = answers_chat(url, args.start_timeout)
    if error is not None:
        proc.stop()
        return f"did not answer a chat completion within {args.start_timeout:.0f} s: {error}"
    return proc, url


def start_rust_router(
    kind: str, args: argparse.Namespace, engine_url: str
) -> tuple[Proc, str] | str:
    """(process, url) of a started router, or why it was skipped."""
    port = free_port()
    common = [
        "--worker-urls",
        engine_url,
        "--port",
        str(port),
        "--log-level",
        "error",
        "--prometheus-port",
        str(free_port()),
    ]
    if kind == "sglang":
        python = str(Path(args.router_bin) / "python") if args.router_bin else sys.executable
        if not Path(python).exists():
            return f"sglang_router is not importable: no interpreter at {python}"
        probe = Proc([python, "-c", "import sglang_router.launch_router"])
        if probe.p.wait(60) != 0:
            probe.stop()
            return f"sglang_router is not importable by {python}"
        probe.stop()
        cmd = [python, "-m", "sglang_router.launch_router", "--policy", args.sglang_policy, *common]
    else:
        exe = (
            str(Path(args.router_bin) / "vllm-router")
            if args.router_bin
            else shutil.which("vllm-router")
        )
        if not exe or not Path(exe).exists():
            return "vllm-router is not installed (see --router-bin)"
        cmd = [exe, "--policy", args.vllm_policy, *common]
    proc = Proc(cmd)
    url = f"http://127.0.0.1:{port}"
    error = answers_chat(url, args.start_timeout)
    if error is not None:
        proc.stop()
        return f"did not answer a chat completion within {args.start_timeout:.0f} s: {error}"
    return proc, url


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--routers", default=",".join(ROUTERS), help="which of kvgate,sglang,vllm,floor to run"
    )
    parser.add_argument(
        "--router-bin", help="bin directory holding the Rust routers (a venv's bin)"
    )
    parser.add_argument("--sglang-policy", default="cache_aware")
    parser.add_argument("--vllm-policy", default="consistent_hash")
    parser.add_argument("--levels", default="1,32", help="concurrency levels")
    parser.add_argument("--modes", default="plain,stream", help="plain and/or stream")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds measured per cell")
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds discarded per cell")
    parser.add_argument("--repeat", type=int, default=5, help="alternating rounds per cell")
    parser.add_argument(
        "--context-tokens", type=int, default=0, help="agent conversation size (0: short)"
    )
    parser.add_argument(
        "--start-timeout", type=float, default=60.0, help="seconds a router may take to start"
    )
    parser.add_argument(
        "--baseline", help="also run kvgate from this checkout (`base`), in the same rounds"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="also run kvgate with FILE's YAML sections added to its config, in the same rounds",
    )
    args = parser.parse_args()

    wanted = [r for r in args.routers.split(",") if r]
    unknown = sorted(set(wanted) - set(ROUTERS))
    if unknown:
        parser.error(f"unknown router(s) {unknown}; known: {', '.join(ROUTERS)}")
    levels = [int(x) for x in args.levels.split(",")]
    modes = [m == "stream" for m in args.modes.split(",") if m]
    engine_port = free_port()
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
    engine_url = f"http://127.0.0.1:{engine_port}"
    routers: dict[str, tuple[Proc, str]] = {}
    skipped: dict[str, str] = {}
    rows: list[dict[str, Any]] = []
    paired: list[str] = []
    try:
        wait_ready(engine_url + "/health")
        for name in wanted:
            if name == "kvgate":
                started: tuple[Proc, str] | str = start_gateway(engine_url, "h1")
            elif name == "floor":
                started = start_floor(args, engine_url)
            else:
                started = start_rust_router(name, args, engine_url)
            if isinstance(started, str):
                skipped[name] = started
            else:
                routers[name] = started
        if args.baseline:
            routers["base"] = start_gateway(engine_url, "h1", code=Path(args.baseline).resolve())
        for variant in args.variant:
            name, _, path = variant.partition("=")
            routers[name] = start_gateway(engine_url, "h1", extra_yaml=Path(path).read_text())
        for stream in modes:
            for conc in levels:
                direct: list[dict[str, Any]] = []
                runs: dict[str, list[dict[str, Any]]] = {name: [] for name in routers}
                for _ in range(args.repeat):
                    direct.append(
                        run_loadgen(
                            engine_url + "/v1/chat/completions",
                            conc,
                            args.duration,
                            stream,
                            args.warmup,
                            args.context_tokens,
                        )
                    )
                    for name, (proc, url) in routers.items():
                        cpu0 = tree_cpu_seconds(proc.p.pid)
                        r = run_loadgen(
                            url + "/v1/chat/completions",
                            conc,
                            args.duration,
                            stream,
                            args.warmup,
                            args.context_tokens,
                        )
                        cpu1 = tree_cpu_seconds(proc.p.pid)
                        if cpu0 is not None and cpu1 is not None:
                            total = r["requests"] * (args.duration + args.warmup) / args.duration
                            r["gw_cpu_us"] = (cpu1 - cpu0) / max(1.0, total) * 1e6
                        runs[name].append(r)
                paired.extend(_paired(runs, conc, stream))
                d = median_row(direct)
                rows.append({"router": "direct", "conc": conc, "stream": stream, **d})
                for name, rs in runs.items():
                    row = median_row(rs)  # no gw_cpu_us if the router died
                    row["added"] = statistics.median(
                        r["p50_ms"] - dd["p50_ms"] for r, dd in zip(rs, direct)
                    )
                    row["ratio"] = row["rps"] / d["rps"] if d["rps"] else float("nan")
                    rows.append({"router": name, "conc": conc, "stream": stream, **row})
    finally:
        for proc, _ in routers.values():
            proc.stop()
        engine.stop()

    print(
        f"{'router':8} {'conc':>4} {'stream':>6} {'req/s':>7} {'p50ms':>7} {'p99ms':>7} {'+p50ms':>7} "
        f"{'ratio':>6} {'CPUus':>6} {'xRust':>6} {'err':>4}"
    )
    nan = float("nan")
    for row in rows:
        cpu = row.get("gw_cpu_us", nan)
        versus = over_rust(rows, row)
        print(
            f"{row['router']:8} {row['conc']:>4} {row['stream']!s:>6} {row['rps']:>7.0f} {row['p50_ms']:>7.2f} "
            f"{row['p99_ms']:>7.2f} {row.get('added', nan):>7.2f} {row.get('ratio', nan):>6.2f} "
            f"{cpu:>6.0f} {versus:>6.2f} {row['errors']:>4}"
        )
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    if paired:
        print("CPU per request over kvgate's, round by round (median, min-max):")
        print("\n".join(paired))
    print(
        f"Medians over {args.repeat} alternating rounds of {args.duration:g} s. +p50ms: router p50 minus "
        "the same round's direct p50. CPUus: the router's process tree, user+system, per request; "
        "xRust: that over the cheaper Rust router's in the same cell."
    )
    if args.context_tokens:
        print(f"Each request: an agent conversation of about {args.context_tokens:,} tokens.")
    else:
        print_against_previous(rows)
    return 0


def over_rust(rows: list[dict[str, Any]], row: dict[str, Any]) -> float:
    """`row`'s CPU per request over the cheaper Rust router's in the same cell (nan: none)."""
    nan = float("nan")
    rust = [
        r.get("gw_cpu_us", nan)
        for r in rows
        if r["router"] in ("sglang", "vllm")
        and (r["conc"], r["stream"]) == (row["conc"], row["stream"])
    ]
    return row.get("gw_cpu_us", nan) / min(rust) if rust else nan


def _paired(runs: dict[str, list[dict[str, Any]]], conc: int, stream: bool) -> list[str]:
    """Each other router's CPU per request over kvgate's in the same round."""
    mine = runs.get("kvgate", [])
    lines = []
    for name, rs in runs.items():
        if name == "kvgate":
            continue
        ratios = [
            r["gw_cpu_us"] / k["gw_cpu_us"]
            for r, k in zip(rs, mine)
            if r.get("gw_cpu_us") and k.get("gw_cpu_us")
        ]
        if ratios:
            lines.append(
                f"  {name:8} {conc:>4} {stream!s:>6} {statistics.median(ratios):6.2f} "
                f"{min(ratios):.2f}-{max(ratios):.2f}"
            )
    return lines


def print_against_previous(rows: list[dict[str, Any]]) -> None:
    """kvgate's cells over the previous release's (docs/scale.md), short prompts only."""
    release, cells = previous_release()
    if not cells:
        print(f"no previous release figures in {PREVIOUS_DOC.name} (after {PREVIOUS_MARKER})")
        return
    nan = float("nan")
    print(f"Against the previous release ({release}, docs/{PREVIOUS_DOC.name}), kvgate:")
    print(
        f"{'stream':>6} {'conc':>4} {'CPUus':>6} {'before':>6} {'now/b':>6} "
        f"{'xRust':>6} {'before':>6} {'+p50ms':>7} {'before':>7}"
    )
    for row in rows:
        old = cells.get((row["stream"], row["conc"]))
        if row["router"] != "kvgate" or old is None:
            continue
        cpu = row.get("gw_cpu_us", nan)
        versus = over_rust(rows, row)
        print(
            f"{row['stream']!s:>6} {row['conc']:>4} {cpu:>6.0f} {old['cpu']:>6.0f} "
            f"{cpu / old['cpu']:>6.2f} {versus:>6.2f} {old['xrust']:>6.2f} "
            f"{row.get('added', nan):>7.2f} {old['added']:>7.2f}"
        )
    print(
        "now/b: CPU per request now over the previous release's (absolute CPU moves with the "
        "machine's load; xRust, measured in the same rounds, compares better)."
    )


if __name__ == "__main__":
    sys.exit(main())
