"""Instructions per request through a router, counted by valgrind's callgrind.

bench_overhead.py and bench_routers.py time CPU per request; on a shared 2-core machine
those figures move 20-50% between rounds, too much to tell a 3% change. Instructions do
not move with the neighbours: each router runs under `valgrind --tool=callgrind` with
instrumentation off, is warmed up, and then counted over a fixed number of sequential
requests (one client) against the `instant` simulated engine (not counted, not under
valgrind). What the router does meanwhile on its own timers (health probes, scrapes, the
console sampler) is measured apart over an idle window and taken off at the same rate per
second, so only the request path is left. Those timers run by the wall clock, which
callgrind slows 50-fold, and some change pace with traffic (a quiet replica is probed less
often), so an idle window does not match a busy one well: by default kvgate's scrape,
probe and console-sample intervals are slowed to 30 s or more (`--default-timers` keeps
them): rounds then spread 0.3-4% instead of 6-17% (docs/scale.md).

    python loadtests/bench_instructions.py                        # kvgate, plain and stream
    python loadtests/bench_instructions.py --baseline ../before   # + another checkout (base)
    python loadtests/bench_instructions.py --code ../after --baseline ../before
    python loadtests/bench_instructions.py --router-bin /tmp/routers/bin --targets kvgate,vllm

Targets: `kvgate` (this checkout, default settings as bench_overhead.py runs it), `base`
(`--baseline DIR`), `vllm` and `sglang` (the Rust routers, installed apart: see
bench_routers.py) and `floor` (loadtests/floor_app.py, kvgate's server and upstream
client alone). Per target and mode: instructions per request (median of `--rounds`
counts, with their range) and each over the first target's. A Python process runs about
50 times slower under callgrind: start-up takes a minute or two, each request some tens
of milliseconds; a figure is for one client, not for 32 (concurrency changes how much
work one event-loop wake-up serves). Needs valgrind (Debian's `valgrind`).
"""

from __future__ import annotations

import argparse
import http.client
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from bench_overhead import MODEL, Proc, chat_body, free_port, wait_ready
from bench_routers import answers_chat

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("kvgate", "base", "vllm", "sglang", "floor")


def counted(cmd: list[str], out_dir: Path) -> list[str]:
    """`cmd` under callgrind, counting nothing until told (callgrind_control -i on)."""
    return [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out_dir}/cg.%p",
        *cmd,
    ]


def target_command(name: str, args: argparse.Namespace, engine: str, port: int) -> list[str]:
    if name in ("kvgate", "base"):
        cfg = Path(tempfile.mkdtemp()) / "bench.yaml"
        cfg.write_text(
            f"server:\n  port: {port}\n  log_level: warning\n"
            f"replicas:\n  - url: {engine}\n    id: engine\n    models: [{MODEL}]\n"
            "upstream:\n  client: h1\n"
            + (
                "health:\n  interval_s: 5\n"
                if args.default_timers
                # Keys both this checkout and older ones know (a baseline must start).
                else "health:\n  interval_s: 3600\nscrape:\n  interval_s: 30\n  stale_after_s: 120\n  lease_ttl_s: 60\n"
                "console:\n  sample_interval_s: 60\n"
            )
        )
        return [sys.executable, "-m", "gateway.cli", "serve", "-c", str(cfg)]
    if name == "floor":
        return [sys.executable, str(ROOT / "loadtests" / "floor_app.py"), str(port)]
    common = ["--worker-urls", engine, "--port", str(port), "--log-level", "error"]
    common += ["--prometheus-port", str(free_port())]
    bin_dir = Path(args.router_bin) if args.router_bin else None
    if name == "sglang":
        python = str(bin_dir / "python") if bin_dir else sys.executable
        return [python, "-m", "sglang_router.launch_router", "--policy", "cache_aware", *common]
    exe = str(bin_dir / "vllm-router") if bin_dir else (shutil.which("vllm-router") or "")
    return [exe, "--policy", "consistent_hash", *common]


def control(pid: int, *argv: str) -> None:
    subprocess.run(["callgrind_control", *argv, str(pid)], check=True, capture_output=True)


def count(pid: int, out_dir: Path, work: Callable[[], object]) -> tuple[int, float]:
    """Instructions the process executed while `work()` ran, and the wall seconds."""
    before = set(out_dir.glob(f"cg.{pid}.*"))
    control(pid, "-z")
    control(pid, "-i", "on")
    t0 = time.monotonic()
    work()
    elapsed = time.monotonic() - t0
    control(pid, "-d")
    control(pid, "-i", "off")
    dumps = sorted(set(out_dir.glob(f"cg.{pid}.*")) - before, key=lambda p: p.stat().st_mtime)
    for line in dumps[-1].read_text().splitlines():
        if line.startswith("summary:") or line.startswith("totals:"):
            return int(line.split()[1]), elapsed
    raise RuntimeError(f"no totals in {dumps[-1]}")


def requests(url: str, n: int, stream: bool, context_tokens: int) -> None:
    """`n` chat completions, one after another on one keep-alive connection."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    body = chat_body(context_tokens, stream)
    try:
        for i in range(n):
            headers = {"content-type": "application/json", "x-session-id": f"c0-{i % 8}"}
            conn.request("POST", "/v1/chat/completions", body, headers)
            resp = conn.getresponse()
            resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{url}: status {resp.status}")
    finally:
        conn.close()


def measure(name: str, args: argparse.Namespace, engine: str) -> dict[str, list[float]] | str:
    """Per mode, instructions per request of each round; or why the target was skipped."""
    port = free_port()
    out_dir = Path(tempfile.mkdtemp(prefix=f"cg-{name}-"))
    cmd = target_command(name, args, engine, port)
    if not cmd[0] or not (Path(cmd[0]).exists() or shutil.which(cmd[0])):
        return "not installed (see --router-bin)"
    env = {"PYTHONHASHSEED": "0"}
    code: Path | str = ROOT
    if name == "base" or (name == "kvgate" and args.code):
        code = Path(args.baseline if name == "base" else args.code).resolve()
        env["PYTHONPATH"] = str(code)
    if name == "floor":
        env["FLOOR_ENGINE"] = engine
    proc = Proc(counted(cmd, out_dir), env=env, cwd=code)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.start_timeout
        while (error := answers_chat(url, 5.0)) is not None:
            if proc.p.poll() is not None:
                stderr = proc.p.stderr.read().decode(errors="replace") if proc.p.stderr else ""
                return f"exited with {proc.p.returncode}: {stderr.strip()[-400:]}"
            if time.monotonic() > deadline:
                return f"did not answer within {args.start_timeout:.0f} s: {error}"
        pid = proc.p.pid
        result: dict[str, list[float]] = {}
        for mode in args.modes.split(","):
            stream = mode == "stream"
            requests(url, args.warmup, stream, args.context_tokens)
            per: list[float] = []
            for _ in range(args.rounds):
                idle, idle_s = count(pid, out_dir, lambda: time.sleep(args.idle_s))
                busy, busy_s = count(
                    pid, out_dir, partial(requests, url, args.requests, stream, args.context_tokens)
                )
                per.append((busy - idle / idle_s * busy_s) / args.requests)
            result[mode] = per
        return result
    finally:
        proc.stop()
        shutil.rmtree(out_dir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--targets", default="kvgate", help=f"comma-separated: {TARGETS}")
    parser.add_argument("--baseline", help="another checkout, run as target `base`")
    parser.add_argument("--code", help="run target `kvgate` from this checkout instead")
    parser.add_argument("--router-bin", help="bin directory holding the Rust routers")
    parser.add_argument("--modes", default="plain,stream")
    parser.add_argument("--requests", type=int, default=200, help="counted per round")
    parser.add_argument("--warmup", type=int, default=100, help="uncounted, per mode")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=3.0, help="idle window per round")
    parser.add_argument("--context-tokens", type=int, default=0)
    parser.add_argument(
        "--default-timers",
        action="store_true",
        help="keep kvgate's scrape, probe and console-sample intervals (noisier counts)",
    )
    parser.add_argument("--start-timeout", type=float, default=600.0)
    args = parser.parse_args()
    names = [t for t in args.targets.split(",") if t]
    if args.baseline and "base" not in names:
        names.append("base")
    unknown = [t for t in names if t not in TARGETS]
    if unknown or ("base" in names and not args.baseline):
        parser.error(f"unknown targets {unknown} (or `base` without --baseline)")
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (Debian: valgrind)", file=sys.stderr)
        return 2
    engine_port = free_port()
    engine = Proc(
        [sys.executable, "-m", "gateway.cli", "sim", "--profile", "instant"]
        + ["--port", str(engine_port)]
    )
    engine_url = f"http://127.0.0.1:{engine_port}"
    results: dict[str, dict[str, list[float]] | str] = {}
    try:
        wait_ready(engine_url + "/health")
        for name in names:
            results[name] = measure(name, args, engine_url)
    finally:
        engine.stop()
    first = next((r for r in results.values() if not isinstance(r, str)), None)
    print(
        f"instructions per request, {args.requests} sequential requests x {args.rounds} rounds, "
        f"context {args.context_tokens} tokens (median, min..max; ratio to the first target)"
    )
    for name, result in results.items():
        if isinstance(result, str):
            print(f"{name:8} skipped: {result}")
            continue
        for mode, per in result.items():
            med = statistics.median(per)
            ratio = med / statistics.median(first[mode]) if first and mode in first else 1.0
            print(
                f"{name:8} {mode:6} {med:>12,.0f}  ({min(per):,.0f}..{max(per):,.0f})  x{ratio:.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
