"""CPU per `/metrics` scrape, whole exposition against selective reads (`name[]`).

The engine is served in a subprocess (its CPU is not counted), under uvicorn, with vLLM's two
`/metrics` routes (the whole registry at `/metrics`, whatever the query, as
prometheus-fastapi-instrumentator's handler answers; prometheus-client's ASGI app under it)
over a registry holding every series vLLM 0.33 registers (names, kinds and label names
recorded from its wheel in tests/fixtures/engines; prometheus-client's default histogram
buckets), or `kvgate sim` (`--engine sim`). The gateway's scraper reads it in this
process, `--scrapes` times per round, with `scrape.select_series` off and on in alternating
rounds; it prints the gateway's CPU per scrape (user + system), the wall time of a scrape
(which includes the engine rendering its answer) and the answer's size.

    python loadtests/bench_scrape.py [--engine recorded|sim] [--scrapes 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Runnable from a checkout without installing: the repository root holds gateway/ and plugins/.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx

from gateway.scrape import MetricsScraper, ScrapeSettings
from gateway.scrape.adapters import read_samples_of
from gateway.scrape.config import EngineKind
from gateway.scrape.select import selective_query
from gateway.types import ReplicaId, ReplicaState

RECORDED = ROOT / "tests" / "fixtures" / "engines" / "vllm-0.33.0" / "metrics.json"

# The engine: every recorded series as a real prometheus-client metric, in the global
# registry kind vLLM serves with one API server (collectors known by name).
ENGINE = """
import json, re, sys
import uvicorn
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest, make_asgi_app)
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Mount, Route

series, port = json.load(open(sys.argv[1]))["series"], int(sys.argv[2])
registry = CollectorRegistry(auto_describe=True)
for s in series:
    labels = list(s.get("labels") or [])
    if s["name"] == "vllm:cache_config_info":
        labels = ["num_gpu_blocks", "block_size", "engine"]
    kind = {"gauge": Gauge, "counter": Counter, "histogram": Histogram}[s["kind"]]
    metric = kind(s["name"], "recorded from vLLM 0.33", labels, registry=registry)
    values = {k: {"model_name": "meta-llama/Llama-3.1-8B-Instruct", "engine": "0"}.get(k, "x")
              for k in labels}
    if s["name"] == "vllm:cache_config_info":
        values = {"num_gpu_blocks": "65536", "block_size": "16", "engine": "0"}
    child = metric.labels(**values) if labels else metric
    if kind is Gauge:
        child.set(1.0 if "info" in s["name"] else 0.0)
    elif kind is Counter:
        child.inc(1000)
    else:
        child.observe(0.5)

async def whole(_request):
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

mount = Mount("/metrics", app=make_asgi_app(registry=registry))
mount.path_regex = re.compile("^/metrics(?P<path>.*)$")
app = Starlette(routes=[Route("/metrics", whole), mount])
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_engine(kind: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    if kind == "sim":
        cmd = [
            sys.executable,
            "-m",
            "gateway.cli",
            "sim",
            "--port",
            str(port),
            "--profile",
            "instant",
        ]
    else:
        cmd = [sys.executable, "-c", ENGINE, str(RECORDED), str(port)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(400):
        try:
            if httpx.get(url + "/metrics", timeout=1.0).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"the engine did not start: {' '.join(cmd[:3])}")


async def measure(url: str, select: bool, scrapes: int) -> tuple[float, float]:
    """(CPU µs, wall µs) per scrape."""
    target = ReplicaState(ReplicaId("e0"), url)
    scraper = MetricsScraper(ScrapeSettings(select_series=select), lambda: [], in_flight={})
    await scraper.start()
    try:
        for _ in range(50):  # the whole first read, the client's connection, warm caches
            assert await scraper.scrape_once(target) is not None
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(scrapes):
            await scraper.scrape_once(target)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
        await scraper.stop()
    return cpu / scrapes * 1e6, wall / scrapes * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--engine", choices=["recorded", "sim"], default="recorded")
    ap.add_argument("--scrapes", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    proc, url = start_engine(a.engine)
    try:
        whole = len(httpx.get(url + "/metrics").content)
        query = selective_query(read_samples_of(EngineKind.VLLM))
        selected = len(httpx.get(url + "/metrics/?" + query).content)
        results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(a.rounds):
            for select in (False, True):
                results[select].append(asyncio.run(measure(url, select, a.scrapes)))
        print(
            f"engine: {a.engine}; exposition {whole} bytes whole, {selected} selective; "
            f"{a.scrapes} scrapes x {a.rounds} alternating rounds; "
            f"load {os.getloadavg()[0]:.2f}"
        )
        print("| reads | gateway CPU µs / scrape (median, rounds) | wall µs / scrape (median) |")
        print("|---|---|---|")
        for select, label in ((False, "whole"), (True, "selective (name[])")):
            cpus = [c for c, _ in results[select]]
            walls = [w for _, w in results[select]]
            rounds = ", ".join(f"{c:.0f}" for c in cpus)
            print(
                f"| {label} | {statistics.median(cpus):.0f} ({rounds}) | "
                f"{statistics.median(walls):.0f} |"
            )
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
