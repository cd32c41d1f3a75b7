"""Fleet-size costs: many simulated replicas, several gateways sharing one Redis store.

Processes: `kvgate sim` processes serving `--per-process` engines each (the `instant`
profile), a redis-server on a free port, `--gateways` `kvgate serve` processes sharing it
(and one more gateway over 10 replicas, the memory baseline). It prints:

* start-up time of each gateway (spawn to `/ready`, and to a fresh load of every replica);
* idle CPU per gateway (`/proc` user+system over `--idle-s`), per 100 replicas, and the
  whole machine's CPU meanwhile (the host may be shared: read figures against it);
* memory per replica (RSS of a gateway over N replicas minus the 10-replica one's);
* decision median and p99 over N replicas (the default policy, as bench_decision.py);
* memory per tracked conversation (session placements in the local store, tracemalloc);
* a SIGHUP reload that removes `--reload` replicas and adds as many under load: failed
  requests (must be 0);
* Redis operations per request (INFO commandstats delta under load, minus the idle rate).

With `--py-spy BIN`, each gateway is profiled over the idle window (py-spy's raw collapsed
stacks, one file per gateway, in the printed `profiles` directory); the profiler's own CPU
then shares the host, so take the idle figures of such a run as a profile's, not a row's.

    python loadtests/bench_fleet.py                          # 1,000 replicas, 4 gateways
    python loadtests/bench_fleet.py --replicas 200 --gateways 1 --conversations 200000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_overhead import MODEL, ROOT, cpu_seconds, free_port, wait_ready

sys.path.insert(0, str(ROOT))


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return float(sum(fields) - idle), float(sum(fields))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


CODE = [str(ROOT), str(ROOT)]  # the checkouts the gateways (--code) and sims (--sim-code) run


def env(code: str | None = None) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    out["PYTHONPATH"] = code or CODE[0]
    return out


def a_code() -> str:
    return CODE[0]


def start_sims(replicas: int, per_process: int) -> tuple[list[subprocess.Popen[str]], list[str]]:
    procs: list[subprocess.Popen[str]] = []
    for start in range(0, replicas, per_process):
        n = min(per_process, replicas - start)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "gateway.cli", "sim", "--replicas", str(n), "--port", "0"]
                + ["--profile", "instant", "--model", MODEL],
                cwd=CODE[1],
                env=env(CODE[1]),
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        )
    urls: list[str] = []
    for p, start in zip(procs, range(0, replicas, per_process)):
        n = min(per_process, replicas - start)
        assert p.stdout is not None
        while len(urls) < start + n:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError("a sim process exited")
            m = re.search(r" at (http://\S+)", line)
            if m:
                urls.append(m.group(1))
    return procs, urls


def config(
    urls: list[str],
    redis_url: str,
    port: int,
    interval: float,
    prefix: str,
    overrides: tuple[str, ...] = (),
) -> str:
    replicas = [{"id": f"r{i}", "url": u, "models": [MODEL]} for i, u in enumerate(urls)]
    cfg = {
        "server": {"port": port, "log_level": "warning"},
        "replicas": replicas,
        "models": {"discover": False},
        "health": {"interval_s": 2.0},
        "scrape": {"interval_s": interval},
        "store": {"backend": "redis", "url": redis_url, "key_prefix": prefix},
    }
    for item in overrides:  # `section.field=value`, the value read as JSON (else a string)
        path, _, raw = item.partition("=")
        section, _, field = path.partition(".")
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        cfg.setdefault(section, {})[field] = value
    return json.dumps(cfg)  # JSON is YAML


class Gateway:
    def __init__(
        self, cfg_dir: Path, name: str, urls: list[str], redis_url: str, a: Any, prefix: str
    ) -> None:
        self.prefix = prefix
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.path = cfg_dir / f"{name}.yaml"
        self.interval = a.interval
        self.overrides: tuple[str, ...] = tuple(a.set)
        self.redis_url = redis_url
        self.write(urls)
        self.started = time.perf_counter()
        self.p = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "-c", str(self.path)],
            cwd=a_code(),
            env=env(),
            stdout=subprocess.DEVNULL,
            stderr=open(cfg_dir / f"{name}.log", "w"),  # noqa: SIM115
        )

    def write(self, urls: list[str]) -> None:
        self.path.write_text(
            config(urls, self.redis_url, self.port, self.interval, self.prefix, self.overrides)
        )

    def ready_s(self) -> float:
        wait_ready(self.url + "/ready", timeout=300)
        return time.perf_counter() - self.started

    def fresh_s(self, replicas: int, timeout: float = 300) -> float:
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        while time.perf_counter() - self.started < timeout:
            text = httpx.get(self.url + "/metrics", timeout=10).text
            age: dict[str, float] = {}
            limit: dict[str, float] = {}
            for f in text_string_to_metric_families(text):
                for s in f.samples:
                    if s.name == "kvgate_scrape_age_seconds":
                        age[s.labels["replica"]] = s.value
                    elif s.name == "kvgate_scrape_fresh_for_seconds":
                        limit[s.labels["replica"]] = s.value
            # Fresh as routing judges it: a quiet replica's load counts for longer.
            if len(age) >= replicas and all(a < limit.get(r, 2.0) for r, a in age.items()):
                return time.perf_counter() - self.started
            time.sleep(0.5)
        return float("nan")

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGINT)
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                self.p.kill()


def spy(binary: str, g: Gateway, out: Path, seconds: float) -> subprocess.Popen[bytes]:
    """py-spy over one gateway for `seconds`: collapsed stacks in `out`/<gateway>.txt."""
    return subprocess.Popen(
        [binary, "record", "--pid", str(g.p.pid), "--duration", str(max(1, int(seconds)))]
        + [
            "--rate",
            "200",
            "--nonblocking",
            "--format",
            "raw",
            "-o",
            str(out / f"{g.path.stem}.txt"),
        ]
        + ["--full-filenames"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def commandstats(port: int) -> int:
    import redis

    info = redis.Redis(port=port).info("commandstats")
    return sum(int(v["calls"]) for v in info.values())


async def load(
    urls: list[str], seconds: float, concurrency: int, during: Any = None
) -> dict[str, Any]:
    import aiohttp

    ok = failed = 0
    errors: list[str] = []
    lat: list[float] = []
    stop_at = time.perf_counter() + seconds
    async with aiohttp.ClientSession() as http:

        async def worker(i: int) -> None:
            nonlocal ok, failed
            n = 0
            while time.perf_counter() < stop_at:
                n += 1
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"conversation {i}-{n % 16}"}],
                    "max_tokens": 4,
                }
                t0 = time.perf_counter()
                try:
                    async with http.post(
                        urls[(i + n) % len(urls)] + "/v1/chat/completions",
                        json=body,
                        timeout=aiohttp.ClientTimeout(30),
                    ) as r:
                        await r.read()
                        if r.status == 200:
                            ok += 1
                            lat.append(time.perf_counter() - t0)
                        else:
                            failed += 1
                            errors.append(str(r.status))
                except (aiohttp.ClientError, TimeoutError) as exc:
                    failed += 1
                    errors.append(type(exc).__name__)

        tasks = [asyncio.create_task(worker(i)) for i in range(concurrency)]
        if during is not None:
            await asyncio.sleep(seconds / 3)
            during()
        await asyncio.gather(*tasks)
    return {
        "ok": ok,
        "failed": failed,
        "errors": sorted(set(errors))[:5],
        "p50_ms": statistics.median(lat) * 1000 if lat else float("nan"),
    }


def decision(replicas: int, decisions: int) -> tuple[float, float]:
    from bench_decision import run

    from gateway.routing import RoutingSettings

    r = run(RoutingSettings().policy, replicas, decisions, 250, 500_000)
    return r["choose_p50"], r["choose_p99"]


def conversation_bytes(n: int) -> float:
    from gateway.store.config import StoreSettings
    from gateway.store.memory import MemoryStore
    from gateway.types import ReplicaId, SessionKey

    store = MemoryStore(StoreSettings(local_sessions_max=max(n, 1)))
    replicas = [ReplicaId(f"r{i}") for i in range(1000)]
    keys = [SessionKey(f"{random.getrandbits(128):032x}") for _ in range(n)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i, key in enumerate(keys):
        store.local_assign(key, replicas[i % 1000])
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / n


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--replicas", type=int, default=1000)
    ap.add_argument("--per-process", type=int, default=100, help="simulated engines per process")
    ap.add_argument("--gateways", type=int, default=4)
    ap.add_argument("--interval", type=float, default=0.25, help="scrape.interval_s")
    ap.add_argument("--idle-s", type=float, default=20.0)
    ap.add_argument("--settle-s", type=float, default=10.0, help="after start-up, before idle")
    ap.add_argument("--load-s", type=float, default=6.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--reload", type=int, default=100, help="replicas removed and added by SIGHUP")
    ap.add_argument("--conversations", type=int, default=1_000_000)
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--code", default=str(ROOT), help="checkout the processes run (before/after)")
    ap.add_argument(
        "--sim-code",
        default=None,
        help="checkout the simulated engines run (default: --code); e.g. this one's sims, "
        "which close idle connections after 5 s as vLLM and SGLang do, under an older gateway",
    )
    ap.add_argument("--py-spy", default="", help="py-spy binary: profile each gateway while idle")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="a setting for every gateway (value as JSON), e.g. scrape.idle_interval_s=10",
    )
    a = ap.parse_args()
    for item in a.set:
        path, eq, _ = item.partition("=")
        section, dot, field = path.partition(".")
        if not (eq and dot and section and field) or section == "replicas":
            ap.error(f"--set {item!r}: expected SECTION.FIELD=VALUE (a settings section)")
    CODE[0] = a.code
    CODE[1] = a.sim_code or a.code
    binary = shutil.which("redis-server")
    if binary is None:
        print("redis-server not found")
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    rport = free_port()
    redis_p = subprocess.Popen(
        [binary, "--port", str(rport), "--save", "", "--dir", str(tmp)], stdout=subprocess.DEVNULL
    )
    redis_url = f"redis://127.0.0.1:{rport}/0"
    rows: dict[str, Any] = {"replicas": a.replicas, "gateways": a.gateways, "code": a.code}
    rows["sim_code"] = CODE[1]
    sims: list[subprocess.Popen[str]] = []
    gateways: list[Gateway] = []
    try:
        sims, urls = start_sims(a.replicas + a.reload, a.per_process)
        serving, spare = urls[: a.replicas], urls[a.replicas :]
        # The memory baseline shares no scraping with the fleet's gateways: as a member of
        # theirs it would be preferred for replicas it does not know, which nobody scraped.
        base = Gateway(tmp, "base", serving[:10], redis_url, a, "fleet-base")
        base.ready_s()
        gateways = [
            Gateway(tmp, f"gw{i}", serving, redis_url, a, "fleet") for i in range(a.gateways)
        ]
        rows["ready_s"] = [round(g.ready_s(), 1) for g in gateways]
        rows["all_loads_fresh_s"] = [round(g.fresh_s(a.replicas), 1) for g in gateways]
        time.sleep(a.settle_s)
        cpu0 = [cpu_seconds(g.p.pid) or 0.0 for g in gateways]
        m0, ops0, t0 = machine_cpu(), commandstats(rport), time.perf_counter()
        spies = [spy(a.py_spy, g, tmp, a.idle_s) for g in gateways] if a.py_spy else []
        time.sleep(a.idle_s)
        for s in spies:
            s.wait()
        if spies:
            rows["profiles"] = str(tmp)
        elapsed = time.perf_counter() - t0
        cpu = [((cpu_seconds(g.p.pid) or 0.0) - c) / elapsed * 100 for g, c in zip(gateways, cpu0)]
        m1 = machine_cpu()
        idle_ops_s = (commandstats(rport) - ops0) / elapsed
        rows["idle_cpu_pct"] = [round(c, 1) for c in cpu]
        rows["idle_cpu_pct_per_100_replicas"] = [round(c * 100 / a.replicas, 2) for c in cpu]
        rows["machine_busy_pct_of_2_cores"] = round((m1[0] - m0[0]) / (m1[1] - m0[1]) * 100, 1)
        rows["redis_idle_ops_s"] = round(idle_ops_s, 1)
        rss = [rss_mb(g.p.pid) for g in gateways]
        rows["rss_mb"] = [round(r, 1) for r in rss]
        rows["rss_base_10_replicas_mb"] = round(rss_mb(base.p.pid), 1)
        rows["kb_per_replica"] = round(
            (statistics.median(rss) - rss_mb(base.p.pid)) * 1024 / (a.replicas - 10), 1
        )
        base.stop()
        ops0, t0 = commandstats(rport), time.perf_counter()
        steady = asyncio.run(load([g.url for g in gateways], a.load_s, a.concurrency))
        elapsed = time.perf_counter() - t0
        ops = commandstats(rport) - ops0 - idle_ops_s * elapsed
        rows["load"] = steady
        rows["redis_ops_per_request"] = round(ops / max(1, steady["ok"] + steady["failed"]), 2)

        def reload() -> None:
            swapped = serving[a.reload :] + spare
            for g in gateways:
                g.write(swapped)
                g.p.send_signal(signal.SIGHUP)

        rows["reload_under_load"] = asyncio.run(
            load([g.url for g in gateways], a.load_s, a.concurrency, during=reload)
        )
    finally:
        for g in gateways:
            g.stop()
        for p in sims:
            p.send_signal(signal.SIGINT)
        for p in sims:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        redis_p.kill()
    if a.decisions > 1:  # 0 skips the phase (an idle profile needs none of the others)
        p50, p99 = decision(a.replicas, a.decisions)
        rows["decision_us_p50_p99"] = [round(p50, 1), round(p99, 1)]
    if a.conversations:
        rows["bytes_per_conversation"] = round(conversation_bytes(a.conversations), 1)
        rows["conversations"] = a.conversations
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
