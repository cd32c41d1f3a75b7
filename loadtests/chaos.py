"""Chaos suite (issue 19): real processes on loopback, one fault per scenario, one table.

Every scenario starts its own processes: `kvgate sim --replicas 1` per engine (so one can be
killed and restarted on its port), one or two `kvgate serve` gateways, a `redis-server` on a
free port for the Redis scenario, and, where the simulated engine cannot misbehave the way a
scenario needs, a raw asyncio engine inside this process. Load is asyncio + httpx, bounded in
time; each worker is one session (`x-session-id`) and the `x-kvgate-replica` header of every
answer says where it went.

    python loadtests/chaos.py                      # every scenario, a few minutes
    python loadtests/chaos.py --only kill,stall --duration 4
    python loadtests/chaos.py --list
    python loadtests/chaos.py --only unhealthy70 --gateway-src /tmp/kvgate-before

Columns: requests sent; fail<1B: well-formed requests that got no answer (a transport error
before the response headers, or a non-2xx the gateway made itself; 429s from admission are in
the notes); broken: 200 answers cut mid-stream (expected: the streams in flight on a killed
or stalled replica); gw5xx: 5xx made by the gateway (no x-kvgate-replica header); relay5xx:
engine 5xx relayed; moved/ret: sessions whose replica changed / that came back to their first;
eject/readmit: seconds from the fault (the repair) to kvgate_replica_healthy 0 (1) in
/metrics; RSS: gateway VmRSS peak/end in MB; inflight: kvgate_in_flight plus admission queue
depth summed at the end (after up to 3 s to settle).

Targets checked per row: 0 fail<1B while a replica is healthy; 0 gw5xx under any client
input; no healthy replica ejected (overload, poison); RSS peak within 20% of the warm RSS
(overload, fuzz); in-flight 0 at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The in-process scenarios (poison) import the gateway from this checkout.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from bench_overhead import MODEL, Proc, free_port, wait_ready

RSS_FLAT = 1.2  # peak within 20% of the warm RSS
SETTLE_S = 3.0  # how long in-flight gauges get to return to 0 once load stops
REPLICA = "x-kvgate-replica"


# -- results --------------------------------------------------------------------------
@dataclass
class Row:
    scenario: str
    requests: int = 0
    failed_before: int = 0
    broken: int = 0
    gw5xx: int = 0
    relayed5xx: int = 0
    moved: int | None = None
    returned: int | None = None
    eject_s: float | None = None
    readmit_s: float | None = None
    rss_peak_mb: float | None = None
    rss_end_mb: float | None = None
    inflight_end: int | None = None
    checks: dict[str, bool] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        failed = [k for k, ok in self.checks.items() if not ok]
        return "PASS" if not failed else "FAIL " + ",".join(failed)


@dataclass
class Tally:
    """What the clients saw."""

    requests: int = 0
    failed_before: int = 0
    broken: int = 0
    gw5xx: int = 0
    relayed5xx: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    sessions: dict[str, list[str]] = field(default_factory=dict)
    wrong_answers: int = 0
    answered: Counter[tuple[str, int]] = field(default_factory=Counter)  # (replica, status)

    def status(self, code: int, relayed: bool) -> None:
        self.statuses[code] += 1
        if code >= 500:
            if relayed:
                self.relayed5xx += 1
                return
            self.gw5xx += 1
        if code != 429 and not relayed:
            self.failed_before += 1

    def moved_returned(self) -> tuple[int, int]:
        moved = [s for s in self.sessions.values() if len(set(s)) > 1]
        return len(moved), sum(1 for s in moved if s[-1] == s[0])

    def into(self, row: Row, sessions: bool = True) -> None:
        row.requests += self.requests
        row.failed_before += self.failed_before
        row.broken += self.broken
        row.gw5xx += self.gw5xx
        row.relayed5xx += self.relayed5xx
        if sessions:
            row.moved, row.returned = self.moved_returned()
        odd = {k: v for k, v in self.statuses.items() if k != 200}
        if odd:
            row.notes.append("statuses " + " ".join(f"{k}x{v}" for k, v in sorted(odd.items())))
        if self.errors:
            row.notes.append(
                "client errors " + ", ".join(f"{k}x{v}" for k, v in self.errors.most_common(4))
            )


# -- processes ------------------------------------------------------------------------
def _drain(proc: Proc, lines: deque[str]) -> None:
    """Read a child's stderr so a chatty process never blocks on a full pipe."""
    stream = proc.p.stderr

    def run() -> None:
        if stream is None:
            return
        # The reader owns the pipe: it closes it at EOF (the child exited or was killed),
        # so a killed and restarted child leaves no open pipe behind for the collector.
        with contextlib.suppress(ValueError, OSError), stream:
            for raw in stream:
                lines.append(raw.decode("utf-8", "replace").rstrip())

    threading.Thread(target=run, daemon=True).start()


def _tracebacks(lines: deque[str]) -> int:
    return sum(1 for line in lines if line.startswith("Traceback"))


class Engine:
    """One `kvgate sim` process on a fixed port, so it can be killed and restarted there."""

    def __init__(self, profile: str = "h200-sparse", extra: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.profile = profile
        self.extra = list(extra)
        self.proc: Proc | None = None
        self.log: deque[str] = deque(maxlen=500)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = Proc(
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "sim",
                "--replicas",
                "1",
                "--port",
                str(self.port),
                "--profile",
                self.profile,
                *self.extra,
            ]
        )
        _drain(self.proc, self.log)
        wait_ready(self.url + "/health")

    def kill(self) -> None:
        if self.proc is not None and self.proc.p.poll() is None:
            self.proc.p.kill()
            self.proc.p.wait()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def gateway_config(port: int, urls: Sequence[str], sections: dict[str, Any]) -> dict[str, Any]:
    """Fast health and scrape loops, short timeouts, no discovery; `sections` merged in."""
    base: dict[str, Any] = {
        "server": {"port": port, "log_level": "warning", "drain_timeout_s": 3.0},
        "replicas": [{"id": f"e{i}", "url": u, "models": [MODEL]} for i, u in enumerate(urls)],
        "health": {
            "interval_s": 0.25,
            "timeout_s": 0.5,
            "failure_threshold": 2,
            "success_threshold": 1,
            "cooldown_s": 1.0,
        },
        "scrape": {"interval_s": 0.1},
        "timeouts": {"connect_s": 1.0, "response_headers_s": 3.0, "read_s": 3.0},
        "models": {"discover": False},
    }
    return _merge(base, sections)


class Gateway:
    """One `kvgate serve -c FILE` process (the file is JSON, which YAML reads)."""

    def __init__(
        self, urls: Sequence[str], sections: dict[str, Any] | None = None, src: str | None = None
    ) -> None:
        self.port = free_port()
        self.config = gateway_config(self.port, urls, sections or {})
        self.src = src  # another kvgate source tree to run (a before/after comparison)
        self.proc: Proc | None = None
        self.log: deque[str] = deque(maxlen=2000)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.p.pid

    def start(self) -> None:
        path = Path(tempfile.mkdtemp(prefix="chaos-")) / "gateway.yaml"
        path.write_text(json.dumps(self.config))
        argv = [sys.executable, "-m", "gateway.cli", "serve", "-c", str(path)]
        self.proc = Proc(argv) if self.src is None else Proc(argv, cwd=self.src)
        _drain(self.proc, self.log)
        wait_ready(self.url + "/ready")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


class Redis:
    """A real `redis-server` on a free port, no persistence (a restart comes back empty)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.p: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed")
        self.p = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--bind",
                "127.0.0.1",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                import socket

                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def signal(self, sig: signal.Signals) -> None:
        if self.p is not None and self.p.poll() is None:
            self.p.send_signal(sig)

    def kill(self) -> None:
        if self.p is not None and self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


_SERIES = re.compile(
    r"^(kvgate_replica_healthy|kvgate_replica_ejected|kvgate_in_flight|kvgate_admission_queue_depth)"
    r'\{[a-z_]+="([^"]*)"\} (\S+)$',
    re.MULTILINE,
)


_EJECTIONS = re.compile(
    r'^kvgate_replica_ejections_total\{reason="([^"]*)",replica="([^"]*)"\} (\S+)$', re.MULTILINE
)


def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, label, value in _SERIES.findall(text):
        out.setdefault(name, {})[label] = float(value)
    for reason, replica, value in _EJECTIONS.findall(text):
        out.setdefault("kvgate_replica_ejections_total", {})[f"{replica}/{reason}"] = float(value)
    return out


class Watch:
    """Polls a gateway's /metrics (health, in-flight) and VmRSS every 50 ms."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.t0 = time.monotonic()
        self.health: list[tuple[float, dict[str, float]]] = []
        self.rss: list[tuple[float, float]] = []
        self.last: dict[str, dict[str, float]] = {}
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=1.0) as client:
            while True:
                now = time.monotonic()
                rss = rss_mb(self.gw.pid)
                if rss is not None:
                    self.rss.append((now, rss))
                with contextlib.suppress(httpx.HTTPError):
                    self.last = parse_metrics((await client.get(self.gw.url + "/metrics")).text)
                    self.health.append((now, self.last.get("kvgate_replica_healthy", {})))
                await asyncio.sleep(0.05)

    async def __aenter__(self) -> Self:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def first(self, replica: str, value: float, since: float) -> float | None:
        for t, healthy in self.health:
            if t >= since and healthy.get(replica) == value:
                return round(t - since, 2)
        return None

    def ever_ejected(self) -> bool:
        return any(v == 0.0 for _, h in self.health for v in h.values())

    def rss_figures(self, warm_from: float) -> tuple[float | None, float | None, bool]:
        """Peak, end, and whether the peak stays within RSS_FLAT of the RSS at `warm_from`."""
        if not self.rss:
            return None, None, True
        peak = max(r for _, r in self.rss)
        warm = next((r for t, r in self.rss if t >= warm_from), self.rss[-1][1])
        later = [r for t, r in self.rss if t >= warm_from] or [peak]
        return round(peak, 1), round(self.rss[-1][1], 1), max(later) <= warm * RSS_FLAT

    async def settle(self) -> int | None:
        """In-flight gauges and admission queues summed, after up to SETTLE_S to reach 0."""
        deadline = time.monotonic() + SETTLE_S
        total: int | None = None
        async with httpx.AsyncClient(timeout=1.0) as client:
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    m = parse_metrics((await client.get(self.gw.url + "/metrics")).text)
                    total = int(
                        sum(m.get("kvgate_in_flight", {}).values())
                        + sum(m.get("kvgate_admission_queue_depth", {}).values())
                    )
                    if total == 0:
                        return 0
                await asyncio.sleep(0.1)
        return total


async def started(*things: Engine | Gateway | Redis) -> None:
    await asyncio.gather(*(asyncio.to_thread(t.start) for t in things))


async def stopped(*things: Engine | Gateway | Redis) -> None:
    for t in things:
        if isinstance(t, Redis):
            t.kill()
    await asyncio.gather(*(asyncio.to_thread(t.stop) for t in things if not isinstance(t, Redis)))


@contextlib.asynccontextmanager
async def rig(
    engines: int,
    sections: dict[str, Any] | None = None,
    profile: str = "h200-sparse",
    urls: Sequence[str] = (),
    src: str | None = None,
) -> AsyncIterator[tuple[list[Engine], Gateway]]:
    """`engines` sim processes (plus `urls` of engines served elsewhere) behind one gateway
    (run from the kvgate tree `src` when given)."""
    procs = [Engine(profile) for _ in range(engines)]
    gw = Gateway([*(e.url for e in procs), *urls], sections, src)
    try:
        await started(*procs)
        await started(gw)
        yield procs, gw
    finally:
        await stopped(gw, *procs)


def finish(row: Row, gw: Gateway) -> None:
    tb = _tracebacks(gw.log)
    if tb:
        row.notes.append(
            f"gateway logged {tb} traceback(s): {next((x for x in gw.log if 'Error' in x), '')[:120]}"
        )
    row.checks["no_traceback"] = tb == 0


# -- load -----------------------------------------------------------------------------
def request_body(
    kind: str, sid: str, stream: bool, max_tokens: int, n: int | None = None
) -> tuple[str, dict[str, Any]]:
    """A session's request; with `n`, its n-th, a different request each time."""
    text = f"session {sid}: explain why a prefix cache wants sticky routing, briefly."
    if n is not None:
        text += f" (turn {n})"
    if kind == "completions":
        return "/v1/completions", {
            "model": MODEL,
            "prompt": text,
            "max_tokens": max_tokens,
            "stream": stream,
        }
    return "/v1/chat/completions", {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def one_request(
    client: httpx.AsyncClient,
    base: str,
    tally: Tally,
    sid: str,
    *,
    stream: bool,
    kind: str = "chat",
    max_tokens: int = 32,
    check_echo: bool = False,
    turn: int | None = None,
) -> None:
    path, body = request_body(kind, sid, stream, max_tokens, turn)
    tally.requests += 1
    try:
        async with client.stream(
            "POST", base + path, json=body, headers={"x-session-id": sid}
        ) as resp:
            replica = resp.headers.get(REPLICA)
            tally.answered[(replica or "-", resp.status_code)] += 1
            if resp.status_code != 200:
                await resp.aread()
                tally.status(resp.status_code, replica is not None)
                return
            tally.statuses[200] += 1
            if replica:
                tally.sessions.setdefault(sid, []).append(replica)
            try:
                data = await resp.aread()
            except httpx.HTTPError as exc:
                tally.broken += 1
                tally.errors["mid-stream " + type(exc).__name__] += 1
                return
            if stream and b"data: [DONE]" not in data:
                tally.broken += 1
            if check_echo and body["messages"][0]["content"].encode() not in data:
                tally.wrong_answers += 1
    except httpx.HTTPError as exc:
        tally.failed_before += 1
        tally.errors[type(exc).__name__] += 1


async def run_load(
    bases: Sequence[str],
    tally: Tally,
    seconds: float,
    workers: int,
    *,
    prefix: str = "s",
    kinds: Sequence[str] = ("chat",),
    max_tokens: int = 32,
    check_echo: bool = False,
    stream_every: int | None = 2,
    distinct: bool = False,
) -> None:
    """`workers` sessions for `seconds`; worker i streams when i % stream_every == 0 (never
    when None) and sends
    kinds[i % len(kinds)]; successive requests of one session alternate over `bases`.
    A session repeats one request, unless `distinct` (each turn is then a new request)."""
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=workers * 2, max_keepalive_connections=workers * 2)
    timeout = httpx.Timeout(30.0, connect=5.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def worker(i: int) -> None:
            n = 0
            while time.monotonic() < deadline:
                base = bases[n % len(bases)]
                n += 1
                await one_request(
                    client,
                    base,
                    tally,
                    f"{prefix}{i}",
                    stream=stream_every is not None and i % stream_every == 0,
                    kind=kinds[i % len(kinds)],
                    max_tokens=max_tokens,
                    check_echo=check_echo,
                    turn=n if distinct else None,
                )

        await asyncio.gather(*(worker(i) for i in range(workers)))


async def at(t0: float, offset: float, action: Callable[[], Awaitable[None] | None]) -> float:
    """Run `action` at t0 + offset; return when it ran (monotonic)."""
    await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
    when = time.monotonic()
    result = action()
    if result is not None:
        await result
    return when


# -- raw asyncio engines (misbehaviour the simulated engine cannot produce) ------------
class RawEngine:
    """A minimal HTTP/1.1 engine. mode "unsolicited": each answer is preceded by a stray
    103 Early Hints and followed, on the now idle keep-alive connection, by an unsolicited
    408 (the connection stays open); the answer echoes the prompt so a client can tell its own.
    mode "huge": chat answers declare an 8 MiB body, completions stream an endless chunked one."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.server: asyncio.Server | None = None
        self.port = 0
        self.connections = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.server.wait_closed(), 2.0)

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                lines = head.split("\r\n")
                method, path = lines[0].split(" ")[:2]
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (x.partition(":") for x in lines[1:] if ":" in x)
                }
                size = int(headers.get("content-length", "0"))
                body = await reader.readexactly(size) if size else b""
                await self._answer(method, path, body, writer)
        except (
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ConnectionError,
            ValueError,
        ):
            pass
        finally:
            writer.close()

    async def _answer(self, method: str, path: str, body: bytes, w: asyncio.StreamWriter) -> None:
        if path == "/health" or path == "/metrics":
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            await w.drain()
            return
        if not path.startswith("/v1/"):
            w.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            await w.drain()
            return
        if self.mode == "huge":
            await self._huge(path, w)
            return
        try:
            content = json.loads(body)["messages"][0]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            content = ""
        answer = json.dumps(
            {
                "id": "raw",
                "object": "chat.completion",
                "created": 0,
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        ).encode()
        w.write(
            b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n"
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(answer)}\r\n\r\n".encode()
            + answer
            + b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n\r\n"
        )
        await w.drain()

    async def _huge(self, path: str, w: asyncio.StreamWriter) -> None:
        chunk = b"x" * 65536
        if path.startswith("/v1/chat"):
            w.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                + f"content-length: {8 << 20}\r\n\r\n".encode()
            )
            for _ in range(128):
                w.write(chunk)
                await w.drain()
            return
        w.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
        for _ in range(4096):  # 256 MiB at most, if the gateway never stops reading
            w.write(frame)
            await w.drain()


class PoisonKind:
    """ASGI wrapper: 500 (vLLM's error body) for one path, the engine for everything else."""

    def __init__(self, app: Any, path: str) -> None:
        self.app = app
        self.path = path

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == self.path:
            from gateway.sim.wire import error_body

            body = error_body(500, "poisoned: this engine fails every " + self.path)
            await send(
                {
                    "type": "http.response.start",
                    "status": 500,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


# -- scenarios ------------------------------------------------------------------------
@dataclass
class Options:
    duration: float = 6.0
    workers: int = 16
    examples: int = 300
    src: str | None = (
        None  # run the gateway from this kvgate tree (core_dead, error30, unhealthy70)
    )


async def scenario_kill(o: Options) -> list[Row]:
    """kill -9 e0 a quarter in, restart it on its port a little past half-way."""
    row = Row("kill -9 e0, restart")
    async with rig(2) as (engines, gw):
        tally = Tally()
        async with Watch(gw) as watch:
            t0 = time.monotonic()
            load = asyncio.ensure_future(run_load([gw.url], tally, o.duration, o.workers))
            killed = await at(t0, o.duration * 0.25, engines[0].kill)
            await at(t0, o.duration * 0.55, lambda: asyncio.to_thread(engines[0].start))
            restarted = time.monotonic()  # it answers /health again
            await load
            row.eject_s = watch.first("e0", 0.0, killed)
            row.readmit_s = watch.first("e0", 1.0, restarted)
            row.inflight_end = await watch.settle()
            row.rss_peak_mb, row.rss_end_mb, _ = watch.rss_figures(t0)
        tally.into(row)
        row.checks["no_unstarted_fail"] = row.failed_before == 0
        row.checks["no_gw5xx"] = row.gw5xx == 0
        row.checks["ejected"] = row.eject_s is not None
        row.checks["readmitted"] = row.readmit_s is not None
        row.checks["inflight_0"] = row.inflight_end == 0
        finish(row, gw)
    return [row]


async def _set_faults(url: str, faults: dict[str, Any]) -> None:
    async with httpx.AsyncClient(timeout=2.0) as client:
        (await client.post(url + "/admin/faults", json=faults)).raise_for_status()


async def scenario_stall(o: Options) -> list[Row]:
    """e0 accepts and never answers (FaultConfig stall=0) for the middle of the run."""
    row = Row("e0 stalled")
    sections = {
        "timeouts": {"response_headers_s": 1.0, "read_s": 1.0},
        "health": {"canary_timeout_s": 1.0},
    }
    async with rig(2, sections) as (engines, gw):
        tally = Tally()
        async with Watch(gw) as watch:
            t0 = time.monotonic()
            load = asyncio.ensure_future(run_load([gw.url], tally, o.duration, o.workers))
            stalled = await at(
                t0, o.duration * 0.25, lambda: _set_faults(engines[0].url, {"stall": 0})
            )
            cleared = await at(t0, o.duration * 0.6, lambda: _set_faults(engines[0].url, {}))
            await load
            row.eject_s = watch.first("e0", 0.0, stalled)
            row.readmit_s = watch.first("e0", 1.0, cleared) if row.eject_s is not None else None
            row.inflight_end = await watch.settle()
            row.rss_peak_mb, row.rss_end_mb, _ = watch.rss_figures(t0)
        tally.into(row)
        row.notes.append(
            "stall: /health stays 200; a request that times out (headers, or a "
            "stream's first chunk) sends a canary: its timeout ejects e0 and the "
            "request fails over"
        )
        row.checks["ejected"] = row.eject_s is not None
        row.checks["no_gw5xx"] = row.gw5xx == 0
        row.checks["inflight_0"] = row.inflight_end == 0
        finish(row, gw)
    return [row]


async def scenario_poison(o: Options) -> list[Row]:
    """e1 (in-process) answers 500 to every /v1/completions and serves chat; e0 serves both."""
    from gateway.serving import start_server
    from gateway.sim.profiles import PROFILES
    from gateway.sim.server import SimEngine

    row = Row("e1 500 on completions only")
    poisoned = SimEngine(PROFILES["h200-sparse"], index=0)
    poisoned.server = await start_server(
        PoisonKind(poisoned.app, "/v1/completions"), "127.0.0.1", 0
    )
    try:
        async with rig(1, urls=[poisoned.url]) as (_, gw):
            # The in-process engine is listed second: the gateway calls it e1.
            tally = Tally()
            async with Watch(gw) as watch:
                t0 = time.monotonic()
                await run_load(
                    [gw.url],
                    tally,
                    o.duration,
                    o.workers,
                    kinds=("chat", "completions", "completions", "chat"),
                )
                row.inflight_end = await watch.settle()
                row.rss_peak_mb, row.rss_end_mb, _ = watch.rss_figures(t0)
                ejected = watch.ever_ejected()
            tally.into(row)
            row.checks["no_unstarted_fail"] = row.failed_before == 0
            row.checks["no_gw5xx"] = row.gw5xx == 0
            row.checks["no_healthy_ejected"] = not ejected
            row.checks["inflight_0"] = row.inflight_end == 0
            row.notes.append(
                "poison: an in-process sim wrapped to answer 500 on /v1/completions only "
                "(the sim's error fault hits every kind); relayed, not retried"
            )
            finish(row, gw)
    finally:
        await poisoned.stop()
    return [row]


# The gateway's own health defaults (issue 44: the new rows must pass with them).
DEFAULT_HEALTH: dict[str, Any] = {
    "health": {
        "interval_s": 2.0,
        "timeout_s": 1.0,
        "failure_threshold": 3,
        "success_threshold": 2,
        "cooldown_s": 5.0,
    }
}


def _share(tally: Tally, replica: str) -> tuple[int, int]:
    """(answers from `replica`, of which failed)."""
    got = {k: v for k, v in tally.answered.items() if k[0] == replica}
    return sum(got.values()), sum(v for (_, code), v in got.items() if code >= 500)


async def scenario_core_dead(o: Options) -> list[Row]:
    """e0 keeps serving /metrics but its core died: /health 503, every request 500."""
    row = Row("e0 core dead (/health 503)")
    async with rig(2, DEFAULT_HEALTH, src=o.src) as (engines, gw):
        tally = Tally()
        async with Watch(gw) as watch:
            t0 = time.monotonic()
            load = asyncio.ensure_future(
                run_load([gw.url], tally, o.duration, o.workers, distinct=True)
            )
            died = await at(
                t0,
                o.duration * 0.2,
                lambda: _set_faults(engines[0].url, {"unhealthy": True, "error": 500}),
            )
            await load
            row.eject_s = watch.first("e0", 0.0, died)
            row.inflight_end = await watch.settle()
            row.rss_peak_mb, row.rss_end_mb, _ = watch.rss_figures(t0)
            ejections = watch.last.get("kvgate_replica_ejections_total", {})
        tally.into(row)
        late = Tally()  # once it is out, nothing fails
        await run_load([gw.url], late, 1.5, o.workers, distinct=True, prefix="late")
        row.requests += late.requests
        n, _ = _share(late, "e0")
        row.notes.append(
            f"ejections {ejections}; after ejection: {late.requests} requests, {n} to e0, "
            f"{sum(v for (_, c), v in late.answered.items() if c != 200)} not 200"
        )
        row.checks["ejected"] = row.eject_s is not None
        row.checks["out_after"] = n == 0 and late.statuses.get(200, 0) == late.requests
        row.checks["no_gw5xx"] = row.gw5xx == 0
        row.checks["inflight_0"] = row.inflight_end == 0
        finish(row, gw)
    return [row]


async def scenario_error30(o: Options) -> list[Row]:
    """e0 answers 500 to 30% of requests; its /health stays 200 (outlier detection)."""
    row = Row("e0 500 on 30% of requests")
    # A fast engine: the 5xx share is judged over 20 different requests in 10 s.
    async with rig(2, DEFAULT_HEALTH, profile="instant", src=o.src) as (engines, gw):
        await _set_faults(engines[0].url, {"error": 500, "error_rate": 0.3})
        tally = Tally()
        async with Watch(gw) as watch:
            t0 = time.monotonic()
            await run_load([gw.url], tally, o.duration, o.workers, distinct=True)
            row.eject_s = watch.first("e0", 0.0, t0)
            row.inflight_end = await watch.settle()
            row.rss_peak_mb, row.rss_end_mb, _ = watch.rss_figures(t0)
            outlier = watch.last.get("kvgate_replica_ejected", {})
            healthy = watch.last.get("kvgate_replica_healthy", {})
        tally.into(row)
        n, bad = _share(tally, "e0")
        row.notes.append(
            f"e0 answered {n} ({bad} 5xx); kvgate_replica_ejected {outlier}; "
            f"eject s = from the start of the load"
        )
        row.checks["ejected"] = row.eject_s is not None and outlier.get("e0") == 1.0
        row.checks["e1_kept"] = healthy.get("e1") == 1.0
        row.checks["no_gw5xx"] = row.gw5xx == 0
        row.checks["inflight_0"] = row.inflight_end == 0
        finish(row, gw)
    return [row]


async def scenario_unhealthy70(o: Options) -> list[Row]:
    """Issue 44's experiment: e0 unhealthy and failing 70%; 60 requests 12 s later."""
    row = Row("issue 44: e0 unhealthy, 70% 500")
    async with rig(2, DEFAULT_HEALTH, src=o.src) as (engines, gw):
        await _set_faults(engines[0].url, {"unhealthy": True, "error": 500, "error_rate": 0.7})
        async with Watch(gw) as watch:
            t0 = time.monotonic()
            await asyncio.sleep(12.0)
            tally = Tally()
            async with httpx.AsyncClient(timeout=30.0) as client:
                for i in range(60):
                    await one_request(client, gw.url, tally, f"x{i}", stream=False, turn=i)
            row.eject_s = watch.first("e0", 0.0, t0)
            row.inflight_end = await watch.settle()
            healthy = watch.last.get("kvgate_replica_healthy", {})
        tally.into(row)
        n, bad = _share(tally, "e0")
        failed = sum(v for (_, c), v in tally.answered.items() if c != 200)
        row.notes.append(
            f"60 requests 12 s after the fault: {failed} failed, {n} went to e0 ({bad} 5xx); "
            f"kvgate_replica_healthy {healthy}"
        )
        row.checks["no_failed"] = failed == 0
        row.checks["ejected"] = row.eject_s is not None
        row.checks["inflight_0"] = row.inflight_end == 0
        finish(row, gw)
    return [row]


async def scenario_disconnects(o: Options) -> list[Row]:
    """Clients leave before headers, mid-stream and while queued in admission; others go on."""
    row = Row("client disconnects")
    sections = {"admission": {"enabled": True, "saturation": {"max_inflight": 2}}}
    async with rig(2, sections) as (engines, gw):
        well = Tally()
        left: Counter[str] = Counter()
        deadline = time.monotonic() + o.duration

        async def leaver(i: int, how: str) -> None:
            async with httpx.AsyncClient(timeout=30.0) as client:
                while time.monotonic() < deadline:
                    path, body = request_body("chat", f"d{how}{i}", how == "mid-stream", 64)
                    try:
                        if how == "mid-stream":
                            async with client.stream("POST", gw.url + path, json=body) as resp:
                                async for _ in resp.aiter_raw():
                                    break
                        else:  # before headers; queued when admission holds it
                            await client.post(
                                gw.url + path, json=body, timeout=0.15 if how == "early" else 0.05
                            )
                    except httpx.HTTPError:
                        pass
                    left[how] += 1

        async with Watch(gw) as watch:
            t0 = time.monotonic()
            await asyncio.gather(
                run_load([gw.url], well, o.duration, 2, max_tokens=16),
                *(leaver(i, how) for i in range(4) for how in ("early", "mid-stream", "queued")),
            )
            row.inflight_end = await watch.settle()
            row.rss_peak_mb, row.rss_end_mb, _ = watch.rss_figures(t0)
        well.into(row)
        row.requests += sum(left.values())
        aborted = 0
        async with httpx.AsyncClient(timeout=2.0) as client:
            for e in engines:
                text = (await client.get(e.url + "/metrics")).text
                m = re.search(
                    r"^kvgate_sim_client_disconnects_total(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE
                )
                aborted += int(float(m.group(1))) if m else 0
            gm = (await client.get(gw.url + "/metrics")).text
        phases = dict(
            re.findall(
                r'^kvgate_client_disconnects_total\{phase="(\w+)"\} (\S+)$', gm, re.MULTILINE
            )
        )
        waits = re.findall(
            r'^kvgate_admission_wait_seconds_count\{[^}]*outcome="(\w+)"[^}]*\} (\S+)$',
            gm,
            re.MULTILINE,
        )
        queued_left = sum(float(v) for k, v in waits if "disconnect" in k)
        row.notes.append(
            f"disconnects: {dict(left)} sent; gateway counted {phases}, "
            f"{queued_left:.0f} left admission's queue; engines aborted {aborted}"
        )
        row.checks["no_unstarted_fail"] = row.failed_before == 0
        row.checks["no_gw5xx"] = row.gw5xx == 0
        row.checks["inflight_0"] = row.inflight_end == 0
        finish(row, gw)
    return [row]


async def scenario_overload(o: Options, admission: bool) -> Row:
    """5x capacity: two `tiny` engines run 8 sequences each; 80 sessions press on them."""
    row = Row(f"overload 5x, admission {'on' if admission else 'off'}")
    sections: dict[str, Any] = {
        "admission": {"enabled": admission, "max_wait_s": 10.0, "saturation": {"max_inflight": 8}}
    }
    async with rig(2, sections, profile="tiny") as (_, gw):
        tally = Tally()
        async with Watch(gw) as watch:
            t0 = time.monotonic()
            await run_load([gw.url], tally, o.duration, 80, max_tokens=16, prefix="o")
            row.inflight_end = await watch.settle()
            row.rss_peak_mb, row.rss_end_mb, flat = watch.rss_figures(t0 + o.duration * 0.25)
            ejected = watch.ever_ejected()
        tally.into(row)
        row.checks["no_unstarted_fail"] = row.failed_before == 0
        row.checks["no_gw5xx"] = row.gw5xx == 0
        row.checks["no_healthy_ejected"] = not ejected
        row.checks["rss_flat"] = flat
        row.checks["inflight_0"] = row.inflight_end == 0
        finish(row, gw)
    return row


async def scenario_overload_both(o: Options) -> list[Row]:
    """80 sessions on two 8-sequence engines, admission off then on."""
    return [await scenario_overload(o, False), await scenario_overload(o, True)]


async def scenario_unsolicited(o: Options) -> list[Row]:
    """A raw engine sends 103 before each answer and an unsolicited 408 after it."""
    row = Row("unsolicited bytes (103/408)")
    raw = RawEngine("unsolicited")
    await raw.start()
    try:
        async with rig(0, urls=[raw.url], sections={"scrape": {"enabled": False}}) as (_, gw):
            tally = Tally()
            async with Watch(gw) as watch:
                t0 = time.monotonic()
                await run_load(
                    [gw.url],
                    tally,
                    min(o.duration, 4.0),
                    o.workers,
                    check_echo=True,
                    stream_every=None,
                )
                row.inflight_end = await watch.settle()
                row.rss_peak_mb, row.rss_end_mb, _ = watch.rss_figures(t0)
            tally.into(row)
            row.notes.append(
                f"unsolicited: {tally.wrong_answers} answers carried another client's "
                f"prompt; the engine saw {raw.connections} connections"
            )
            row.checks["own_answers"] = tally.wrong_answers == 0
            row.checks["no_unstarted_fail"] = row.failed_before == 0
            row.checks["no_gw5xx"] = row.gw5xx == 0
            row.checks["inflight_0"] = row.inflight_end == 0
            finish(row, gw)
    finally:
        await raw.stop()
    return [row]


async def scenario_slowloris(o: Options) -> list[Row]:
    """200 connections trickle headers, 50 trickle a body; normal load must not notice."""
    row = Row("slowloris")
    header_s, body_s = 1.0, 1.0
    sections = {"server": {"header_timeout_s": header_s, "body_timeout_s": body_s}}
    async with rig(2, sections) as (_, gw):
        closed: list[float] = []

        async def slow(body: bool) -> None:
            t = time.monotonic()
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            try:
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
                if body:
                    writer.write(b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n{")
                for _ in range(int((header_s + 3) / 0.25)):
                    writer.write(b"x" if body else b"x-a: b\r\n")
                    await writer.drain()
                    with contextlib.suppress(asyncio.TimeoutError):
                        if await asyncio.wait_for(reader.read(1024), 0.25) == b"":
                            break
                        break  # an answer (408) counts as closed too
                closed.append(time.monotonic() - t)
            except ConnectionError:
                closed.append(time.monotonic() - t)
            finally:
                writer.close()

        tally = Tally()
        async with Watch(gw) as watch:
            t0 = time.monotonic()
            await asyncio.gather(
                run_load([gw.url], tally, min(o.duration, 5.0), 4),
                *(slow(False) for _ in range(200)),
                *(slow(True) for _ in range(50)),
            )
            row.inflight_end = await watch.settle()
            row.rss_peak_mb, row.rss_end_mb, _ = watch.rss_figures(t0)
        tally.into(row)
        in_time = sum(1 for c in closed if c <= max(header_s, body_s) + 1.5)
        row.notes.append(
            f"slowloris: {in_time} of 250 slow connections closed within "
            f"{max(header_s, body_s) + 1.5:.1f} s (longest {max(closed, default=0):.1f} s)"
        )
        row.checks["slow_closed"] = in_time == 250
        row.checks["no_unstarted_fail"] = row.failed_before == 0
        row.checks["no_gw5xx"] = row.gw5xx == 0
        row.checks["inflight_0"] = row.inflight_end == 0
        finish(row, gw)
    return [row]


async def scenario_oversized(o: Options) -> list[Row]:
    """Client bodies past limits.max_body_bytes (413), engine answers past max_response_bytes (502)."""
    mib = 1 << 20
    raw = RawEngine("huge")
    await raw.start()
    rows = [Row("oversized requests"), Row("oversized answers (502 ok)")]
    sections = {
        "limits": {"max_body_bytes": mib, "max_response_bytes": mib},
        "scrape": {"enabled": False},
    }
    try:
        async with rig(1, sections) as (_, gw), rig(0, sections, urls=[raw.url]) as (_, gw_raw):
            big = json.dumps(
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "x" * (2 * mib)}],
                    "max_tokens": 1,
                }
            ).encode()

            async def chunked() -> AsyncIterator[bytes]:
                for i in range(0, len(big), 65536):
                    yield big[i : i + 65536]

            req, ans = Tally(), Tally()
            async with Watch(gw) as w1, Watch(gw_raw) as w2:
                t0 = time.monotonic()
                async with httpx.AsyncClient(timeout=20.0) as client:
                    for _ in range(10):
                        for content in (big, chunked()):
                            req.requests += 1
                            try:
                                r = await client.post(
                                    gw.url + "/v1/chat/completions",
                                    content=content,
                                    headers={"content-type": "application/json"},
                                )
                                req.statuses[r.status_code] += 1
                                if r.status_code >= 500:
                                    req.gw5xx += REPLICA not in r.headers
                            except httpx.HTTPError as exc:
                                req.errors[type(exc).__name__] += 1
                        for path, body in (
                            request_body("chat", "big", False, 1),
                            request_body("completions", "big", False, 1),
                        ):
                            ans.requests += 1
                            try:
                                r = await client.post(gw_raw.url + path, json=body)
                                ans.statuses[r.status_code] += 1
                                code = (
                                    r.json().get("error", {}).get("code")
                                    if r.status_code >= 500
                                    else None
                                )
                                ans.errors[f"{r.status_code} {code}"] += 1
                                if r.status_code >= 500 and REPLICA not in r.headers:
                                    ans.gw5xx += 1
                            except (httpx.HTTPError, ValueError) as exc:
                                ans.errors[type(exc).__name__] += 1
                for row, w in ((rows[0], w1), (rows[1], w2)):
                    row.inflight_end = await w.settle()
                    row.rss_peak_mb, row.rss_end_mb, _ = w.rss_figures(t0)
            req.into(rows[0], sessions=False)
            # Closing the connection after the 413, mid-upload, is fine too (client errors, in the notes).
            rows[0].checks["only_413"] = set(req.statuses) == {413}
            rows[0].checks["no_gw5xx"] = rows[0].gw5xx == 0
            ans.into(rows[1], sessions=False)
            rows[1].checks["all_too_large"] = (
                ans.errors["502 upstream_response_too_large"] == ans.requests
            )
            base = w2.rss[0][1] if w2.rss else 0.0
            rows[1].checks["rss_bounded"] = (rows[1].rss_peak_mb or 0.0) < base + 100
            rows[1].notes.append(
                "oversized answers: chat declares 8 MiB, completions stream "
                "endless chunks; limit 1 MiB; these 502s are the intended answer"
            )
            for row, g in ((rows[0], gw), (rows[1], gw_raw)):
                row.checks["inflight_0"] = row.inflight_end == 0
                finish(row, g)
    finally:
        await raw.stop()
    return rows


async def scenario_redis(o: Options) -> list[Row]:
    """Two gateways share a Redis that is killed, restarted empty, then frozen (SIGSTOP)."""
    row = Row("redis kill/empty/SIGSTOP, 2 gw")
    redis = Redis()
    await started(redis)
    engines = [Engine(), Engine()]
    store = {"store": {"backend": "redis", "url": redis.url}}
    gws = [Gateway([e.url for e in engines], store), Gateway([e.url for e in engines], store)]
    try:
        await started(*engines)
        await started(*gws)
        tally = Tally()
        async with Watch(gws[0]) as w1, Watch(gws[1]) as w2:
            t0 = time.monotonic()
            d = o.duration
            load = asyncio.ensure_future(run_load([g.url for g in gws], tally, d, o.workers))
            await at(t0, d * 0.15, redis.kill)
            await at(t0, d * 0.35, lambda: asyncio.to_thread(redis.start))
            await at(t0, d * 0.55, lambda: redis.signal(signal.SIGSTOP))
            await at(t0, d * 0.8, lambda: redis.signal(signal.SIGCONT))
            await load
            ends = [await w.settle() for w in (w1, w2)]
            row.inflight_end = None if None in ends else sum(e or 0 for e in ends)
            figures = [w.rss_figures(t0) for w in (w1, w2)]
            row.rss_peak_mb = max((f[0] or 0.0) for f in figures)
            row.rss_end_mb = max((f[1] or 0.0) for f in figures)
            ejected = w1.ever_ejected() or w2.ever_ejected()
        tally.into(row)
        row.notes.append(
            "redis: each session alternates between the two gateways; moved = a "
            "session answered by two replicas"
        )
        row.checks["no_unstarted_fail"] = row.failed_before == 0
        row.checks["no_gw5xx"] = row.gw5xx == 0
        row.checks["no_healthy_ejected"] = not ejected
        row.checks["inflight_0"] = row.inflight_end == 0
        for g in gws:
            finish(row, g)
    finally:
        redis.signal(signal.SIGCONT)
        await stopped(*gws, *engines, redis)
    return [row]


def fuzz(url: str, examples: int, tally: Tally, samples: list[str]) -> None:
    """Hypothesis over methods, paths, headers and bodies; no 5xx may come from the gateway."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = (
        st.none()
        | st.booleans()
        | st.integers(-(2**70), 2**70)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=40)
    )
    values = st.recursive(
        scalars,
        lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=8), ch, max_size=4),
        max_leaves=12,
    )
    message = st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "tool"]) | values,
            "content": st.text(max_size=200) | values,
        }
    )
    request = st.fixed_dictionaries(
        {},
        optional={
            "model": st.sampled_from([MODEL, "other"]) | values,
            "messages": st.lists(message, max_size=3) | values,
            "prompt": st.text(max_size=200) | st.lists(st.integers(0, 50000), max_size=20) | values,
            "stream": st.booleans() | values,
            "max_tokens": st.integers(-2, 64) | values,
            "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | values})
            | values,
            "priority": st.integers(-3, 3) | values,
            "kv_transfer_params": values,
            "n": st.integers(-1, 3),
            "input": st.text(max_size=50) | values,
            "user": st.text(max_size=20),
        },
    )
    bodies = (
        request.map(lambda d: json.dumps(d).encode())
        | st.binary(max_size=300)
        | values.map(lambda v: json.dumps(v).encode())
    )
    header_names = st.sampled_from(
        [
            "content-type",
            "x-session-id",
            "x-priority",
            "x-tenant-id",
            "authorization",
            "x-request-id",
            "accept",
            "accept-encoding",
            "x-kvgate-replica",
            "transfer-encoding",
            "expect",
            "connection",
            "te",
            "upgrade",
            "x-forwarded-for",
            "host",
            "cookie",
            "x-smg-routing-key",
        ]
    )
    header_values = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
    paths = st.sampled_from(
        [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/embeddings",
            "/v1/models",
            "/v1/chat/completions?x=1",
            "/v1/../metrics",
            "/nope",
            "//v1/completions",
            "/v1/models/kvgate-sim",
            "/v1/chat/completions/",
        ]
    )
    methods = st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "OPTIONS"])
    client = httpx.Client(timeout=10.0)

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(methods, paths, st.dictionaries(header_names, header_values, max_size=5), bodies)
    def probe(method: str, path: str, headers: dict[str, str], body: bytes) -> None:
        tally.requests += 1
        try:
            r = client.request(method, url + path, content=body, headers=headers)
        except httpx.HTTPError as exc:
            tally.errors[type(exc).__name__] += 1
            return
        tally.statuses[r.status_code] += 1
        if r.status_code >= 500:
            if REPLICA in r.headers:
                tally.relayed5xx += 1
            else:
                tally.gw5xx += 1
                samples.append(f"{method} {path} {headers} -> {r.status_code} {r.text[:80]}")

    try:
        probe()
    finally:
        client.close()


async def scenario_fuzz(o: Options) -> list[Row]:
    """Hypothesis over methods, paths, headers and bodies against two `instant` engines."""
    row = Row(f"fuzz bodies+headers ({o.examples})")
    async with rig(2, profile="instant") as (_, gw):
        tally = Tally()
        samples: list[str] = []
        async with Watch(gw) as watch:
            t0 = time.monotonic()
            await asyncio.to_thread(fuzz, gw.url, o.examples, tally, samples)
            elapsed = time.monotonic() - t0
            row.inflight_end = await watch.settle()
            row.rss_peak_mb, row.rss_end_mb, flat = watch.rss_figures(t0 + elapsed * 0.25)
        tally.into(row, sessions=False)
        row.notes.extend(f"fuzz 5xx: {s}" for s in samples[:3])
        row.checks["no_gw5xx"] = row.gw5xx == 0
        row.checks["rss_flat"] = flat
        row.checks["inflight_0"] = row.inflight_end == 0
        row.checks["alive"] = gw.proc is not None and gw.proc.p.poll() is None
        finish(row, gw)
    return [row]


async def scenario_sigterm(o: Options) -> list[Row]:
    """SIGTERM with 8 streams of about 2 s in flight: they finish, then the gateway exits 0."""
    row = Row("SIGTERM, streams in flight")
    async with rig(2, {"server": {"drain_timeout_s": 10.0}}) as (_, gw):
        tally = Tally()
        async with Watch(gw) as watch:
            t0 = time.monotonic()
            async with httpx.AsyncClient(timeout=30.0) as client:
                streams = [
                    asyncio.ensure_future(
                        one_request(client, gw.url, tally, f"t{i}", stream=True, max_tokens=100)
                    )
                    for i in range(8)
                ]
                await asyncio.sleep(0.5)
                assert gw.proc is not None
                gw.proc.p.send_signal(signal.SIGTERM)
                termed = time.monotonic()
                late = Tally()
                for i in range(5):  # new requests after SIGTERM: refused, not counted above
                    await asyncio.sleep(0.1)
                    await one_request(client, gw.url, late, f"late{i}", stream=False, max_tokens=1)
                await asyncio.gather(*streams)
                code = await asyncio.to_thread(gw.proc.p.wait, 15)
                exited = time.monotonic() - termed
            row.rss_peak_mb, row.rss_end_mb, _ = watch.rss_figures(t0)
        tally.into(row)
        row.notes.append(
            f"sigterm: exit code {code} {exited:.1f} s after the signal; "
            f"requests sent after it: {late.requests}, refused {late.failed_before}; "
            "inflight: none left to read, the process is gone"
        )
        row.checks["streams_finished"] = row.broken == 0 and row.failed_before == 0
        # uvicorn re-raises the signal once drained: -15 is a clean exit too.
        row.checks["exited_drained"] = code in (0, -signal.SIGTERM) and exited < 10.0
        row.checks["no_gw5xx"] = row.gw5xx == 0
        finish(row, gw)
    return [row]


SCENARIOS: dict[str, Callable[[Options], Awaitable[list[Row]]]] = {
    "kill": scenario_kill,
    "stall": scenario_stall,
    "poison": scenario_poison,
    "core_dead": scenario_core_dead,
    "error30": scenario_error30,
    "unhealthy70": scenario_unhealthy70,
    "disconnects": scenario_disconnects,
    "overload": scenario_overload_both,
    "unsolicited": scenario_unsolicited,
    "slowloris": scenario_slowloris,
    "oversized": scenario_oversized,
    "redis": scenario_redis,
    "fuzz": scenario_fuzz,
    "sigterm": scenario_sigterm,
}


# -- report ---------------------------------------------------------------------------
def _f(v: float | None, fmt: str = "") -> str:
    return "-" if v is None else format(v, fmt)


def table(rows: Sequence[Row]) -> str:
    head = (
        f"{'scenario':31} {'req':>6} {'fail<1B':>7} {'broken':>6} {'gw5xx':>5} {'relay5xx':>8} "
        f"{'moved/ret':>9} {'eject s':>7} {'readmit':>7} {'RSS MB pk/end':>13} {'inflight':>8}  verdict"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        mr = "-" if r.moved is None else f"{r.moved}/{r.returned}"
        rss = f"{_f(r.rss_peak_mb, '.0f')}/{_f(r.rss_end_mb, '.0f')}"
        lines.append(
            f"{r.scenario[:31]:31} {r.requests:>6} {r.failed_before:>7} {r.broken:>6} "
            f"{r.gw5xx:>5} {r.relayed5xx:>8} {mr:>9} {_f(r.eject_s, '.2f'):>7} "
            f"{_f(r.readmit_s, '.2f'):>7} {rss:>13} {_f(r.inflight_end):>8}  {r.verdict}"
        )
    notes = [f"  [{r.scenario}] {n}" for r in rows for n in r.notes]
    return "\n".join(lines + (["notes:", *notes] if notes else []))


async def run(names: Sequence[str], o: Options, cap_s: float = 120.0) -> list[Row]:
    rows: list[Row] = []
    for name in names:
        try:
            rows.extend(await asyncio.wait_for(SCENARIOS[name](o), cap_s))
        except Exception as exc:  # noqa: BLE001  one broken scenario must not hide the others'
            rows.append(
                Row(name, checks={"ran": False}, notes=[f"{type(exc).__name__}: {exc}"[:200]])
            )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios")
    parser.add_argument("--duration", type=float, default=6.0, help="seconds of load per scenario")
    parser.add_argument(
        "--workers", type=int, default=16, help="concurrent sessions of the plain load"
    )
    parser.add_argument(
        "--examples", type=int, default=300, help="hypothesis examples of the fuzzer"
    )
    parser.add_argument(
        "--gateway-src",
        default=None,
        help="run the gateway of the health scenarios from this kvgate source tree "
        "(e.g. an exported older commit, for a before/after comparison)",
    )
    parser.add_argument("--list", action="store_true", help="name the scenarios and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, fn in SCENARIOS.items():
            print(f"{name:12} {(fn.__doc__ or '').strip().splitlines()[0] if fn.__doc__ else ''}")
        return 0
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    t0 = time.monotonic()
    rows = asyncio.run(
        run(names, Options(args.duration, args.workers, args.examples, args.gateway_src))
    )
    print(table(rows))
    print(
        f"{len(rows)} rows in {time.monotonic() - t0:.0f} s; "
        f"{sum(r.verdict == 'PASS' for r in rows)} PASS"
    )
    return 0 if all(r.verdict == "PASS" for r in rows) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
