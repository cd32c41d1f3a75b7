"""Replay a kvgate/Mooncake trace through Locust (for teams that already run Locust).

    locust -f loadtests/locustfile.py --headless --host http://127.0.0.1:8000 \
        --trace trace.jsonl --speedup 10 -u 64 -r 64

Each request of the trace is sent once, with the same prompt text, max_tokens and session
as `kvgate trace replay` (gateway.trace.replay builds them). Users share one schedule: a
user takes the next request and waits for its arrival time (divided by --speedup; 0 sends
back to back), so -u bounds the concurrency. Besides the request itself, Locust records
"TTFT" and "ITL" entries (milliseconds) and a "cached_tokens" entry whose response length
is the engine-reported cached tokens. The run stops when the trace is exhausted.

Locust is imported only here: it monkey-patches the standard library on import.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import gevent
import orjson
from locust import HttpUser, events, task
from locust.exception import StopUser

from gateway.trace.format import Trace, TraceRecord, read_trace
from gateway.trace.replay import PromptBuilder, build_body


@events.init_command_line_parser.add_listener
def _args(parser: Any) -> None:
    parser.add_argument("--trace", type=str, env_var="KVGATE_TRACE", default="", help="trace file")
    parser.add_argument(
        "--speedup",
        type=float,
        env_var="KVGATE_SPEEDUP",
        default=1.0,
        help="divide arrival times (0: no waiting)",
    )
    parser.add_argument("--model", type=str, env_var="KVGATE_MODEL", default="kvgate-sim")
    parser.add_argument(
        "--endpoint",
        type=str,
        env_var="KVGATE_ENDPOINT",
        default="chat",
        choices=["chat", "completions"],
    )
    parser.add_argument(
        "--trace-limit",
        type=int,
        env_var="KVGATE_TRACE_LIMIT",
        default=0,
        help="use only the first N requests (0: all)",
    )


class _Schedule:
    """The trace as one ordered queue shared by all users (greenlet- and thread-safe)."""

    def __init__(self, trace: Trace, speedup: float) -> None:
        self.trace = trace
        self.speedup = speedup
        self.builder = PromptBuilder(trace.block_tokens)
        self._items: Iterator[tuple[int, TraceRecord]] = iter(enumerate(trace.records))
        self._lock = threading.Lock()
        self.t0 = time.monotonic()
        self.origin = trace.records[0].arrival_s if trace.records else 0.0
        self.in_flight = 0
        self.exhausted = False
        self._quitting = False

    def next(self) -> tuple[int, TraceRecord] | None:
        with self._lock:
            item = next(self._items, None)
            self.exhausted = item is None
            if item is not None:
                self.in_flight += 1
            return item

    def done(self, environment: Any, *, finished_one: bool) -> None:
        """After a request (or on finding the trace empty): quit once nothing is left."""
        with self._lock:
            self.in_flight -= finished_one
            if not self.exhausted or self.in_flight > 0 or self._quitting:
                return
            self._quitting = True
        if environment.runner is not None:
            # quit() kills every user greenlet; run it outside the calling user.
            gevent.spawn(environment.runner.quit)

    def due(self, rec: TraceRecord) -> float:
        if self.speedup <= 0:
            return 0.0
        return self.t0 + (rec.arrival_s - self.origin) / self.speedup


_state: dict[str, _Schedule] = {}


@events.test_start.add_listener
def _load(environment: Any, **_: Any) -> None:
    opts = environment.parsed_options
    if not opts.trace:
        raise SystemExit("--trace (or KVGATE_TRACE) is required")
    trace = read_trace(opts.trace)
    if opts.trace_limit:
        trace = trace.window(0, opts.trace_limit)
    _state["schedule"] = _Schedule(trace, opts.speedup)


class TraceUser(HttpUser):
    # Pacing comes from the trace, not from Locust's wait_time.
    def wait_time(self) -> float:
        return 0.0

    @task
    def replay_next(self) -> None:
        schedule = _state["schedule"]
        item = schedule.next()
        if item is None:
            schedule.done(self.environment, finished_one=False)
            raise StopUser()
        try:
            self._replay(schedule, *item)
        finally:
            schedule.done(self.environment, finished_one=True)

    def _replay(self, schedule: _Schedule, index: int, rec: TraceRecord) -> None:
        delay = schedule.due(rec) - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # cooperative under Locust's gevent
        opts = self.environment.parsed_options
        body = build_body(
            schedule.builder.prompt(rec, index),
            rec,
            model=opts.model,
            endpoint=opts.endpoint,
            ignore_eos=True,
            max_output_tokens=None,
        )
        path = "/v1/chat/completions" if opts.endpoint == "chat" else "/v1/completions"
        headers = {"content-type": "application/json"}
        if rec.session_id:
            headers["x-session-id"] = rec.session_id
        self._send(path, body, headers)

    def _send(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        start = time.monotonic()
        first: float | None = None
        last = start
        usage: dict[str, Any] | None = None
        fire = self.environment.events.request.fire
        with self.client.post(
            path,
            data=orjson.dumps(body),
            headers=headers,
            stream=True,
            catch_response=True,
            name=path,
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}")
                return
            for raw in resp.iter_lines():
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    break
                obj = orjson.loads(data)
                if "error" in obj:
                    resp.failure(f"stream error: {obj['error']}")
                    return
                if obj.get("usage"):
                    usage = obj["usage"]
                if any(
                    (c.get("delta") or {}).get("content") or c.get("text")
                    for c in obj.get("choices") or ()
                ):
                    now = time.monotonic()
                    if first is None:
                        first = now
                        fire(
                            request_type="TTFT",
                            name=path,
                            response_time=(now - start) * 1e3,
                            response_length=0,
                            exception=None,
                            context={},
                        )
                    else:
                        fire(
                            request_type="ITL",
                            name=path,
                            response_time=(now - last) * 1e3,
                            response_length=0,
                            exception=None,
                            context={},
                        )
                    last = now
            resp.success()
        details = (usage or {}).get("prompt_tokens_details") or {}
        if isinstance(details.get("cached_tokens"), int):
            fire(
                request_type="cached_tokens",
                name=path,
                response_time=0,
                response_length=details["cached_tokens"],
                exception=None,
                context={},
            )
