"""Replay a trace against any OpenAI-compatible endpoint (kvgate, a bare engine, a router).

Prompt text is rebuilt from the block hashes: each hash maps to a fixed sequence of
three-letter words ("abc "), one word per token under the ~4 characters/token
approximation, so equal hashes give equal text (the engine's prefix cache sees the trace's
sharing) and prompts have the trace's length; a turn re-sends its parent's text exactly
and appends (`gateway.trace.render` joins the parent's partial last block). Arrivals are replayed open-loop, compressed
by `speedup`, or closed-loop with a fixed `concurrency`. Each request streams, with usage
at the end, so the report has TTFT, inter-token gaps and the engine's `cached_tokens`.
Chat messages are laid out by `gateway.trace.render` (one growing user message, or one
message per turn), and sessions go in headers, inferred when the trace has none.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TextIO

import httpx
import orjson

from gateway.trace.format import Trace, TraceRecord
from gateway.trace.render import (
    LAYOUTS,
    Layout,
    Message,
    Renderer,
    growing_messages,
    session_headers,
)
from gateway.trace.report import ReplayReport, RequestResult
from gateway.trace.routing import DEFAULT_MODEL

Endpoint = Literal["chat", "completions"]
_LETTERS = bytes(range(ord("a"), ord("z") + 1))
# bytes 0..255 -> a..z, so a hash digest becomes letters in one C call.
_TO_LETTERS = bytes(_LETTERS[b % 26] for b in range(256))
_MAX_CACHED_BLOCKS = 50_000
_PROGRESS_EVERY_S = 0.5


class PromptBuilder:
    """Deterministic text for a trace request: same hash, same words."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._cache: dict[int, str] = {}

    @staticmethod
    def words(seed: bytes, tokens: int) -> str:
        raw = hashlib.shake_128(seed).digest(3 * tokens).translate(_TO_LETTERS)
        return " ".join(raw[i : i + 3].decode() for i in range(0, 3 * tokens, 3)) + " "

    def block_text(self, block_hash: int, tokens: int) -> str:
        """`tokens` words for one block; a shorter block is a prefix of the full one."""
        if tokens > self.block_tokens:
            return self.words(b"h" + block_hash.to_bytes(16, "little", signed=True), tokens)
        text = self._cache.get(block_hash)
        if text is None:
            if len(self._cache) >= _MAX_CACHED_BLOCKS:
                self._cache.clear()
            text = self.words(
                b"h" + block_hash.to_bytes(16, "little", signed=True), self.block_tokens
            )
            self._cache[block_hash] = text
        return text[: 4 * tokens]

    def prompt(self, rec: TraceRecord, index: int) -> str:
        if not rec.block_hashes:
            # No prefix information: unique text, so nothing is shared by accident.
            return self.words(b"r" + index.to_bytes(8, "little"), max(1, rec.input_tokens))
        lengths = rec.block_lengths(self.block_tokens)
        return "".join(self.block_text(h, n) for h, n in zip(rec.block_hashes, lengths))


@dataclass(frozen=True, slots=True)
class _Job:
    index: int
    record: TraceRecord
    body: bytes
    headers: Mapping[str, str]


def _v1(base_url: str) -> str:
    url = base_url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def build_body(
    text: str | Sequence[Message],
    rec: TraceRecord,
    *,
    model: str,
    endpoint: Endpoint,
    ignore_eos: bool,
    max_output_tokens: int | None,
) -> dict[str, Any]:
    """The streaming request body; `text` is the prompt, or chat messages already laid out.

    A prompt string sent to chat gets the ``growing`` layout. No `user` field: sessions
    travel in headers (`render.session_headers`), so that they can be switched off.
    """
    max_tokens = max(1, rec.output_tokens)
    if max_output_tokens is not None:
        max_tokens = min(max_tokens, max_output_tokens)
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        body["messages"] = growing_messages(text) if isinstance(text, str) else list(text)
    elif isinstance(text, str):
        body["prompt"] = text
    else:
        raise ValueError("a completions request needs a prompt string, not messages")
    if ignore_eos:
        # vLLM/SGLang extension: generate exactly max_tokens, as the trace did.
        body["ignore_eos"] = True
    return body


class _Progress:
    def __init__(self, out: TextIO | None, total: int) -> None:
        self.out, self.total = out, total
        self.done = self.errors = self.in_flight = 0
        self.start = time.monotonic()
        self._tty = bool(out is not None and out.isatty())
        self._last_line = 0.0

    def show(self, final: bool = False) -> None:
        if self.out is None:
            return
        now = time.monotonic()
        if not (final or self._tty or now - self._last_line >= 5.0):
            return
        self._last_line = now
        width = 30
        filled = width * self.done // self.total if self.total else width
        line = (
            f"replay [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
            f" done, {self.in_flight} in flight, {self.errors} errors, {now - self.start:.1f} s"
        )
        self.out.write(("\r" + line) if self._tty else line + "\n")
        if final and self._tty:
            self.out.write("\n")
        self.out.flush()


async def _one(
    client: httpx.AsyncClient, url: str, job: _Job, t0: float, endpoint: Endpoint
) -> RequestResult:
    start = time.monotonic()
    first: float | None = None
    last: float | None = None
    gaps: list[float] = []
    chunks = 0
    usage: Mapping[str, Any] | None = None
    error: str | None = None
    done = False
    replica: str | None = None
    try:
        async with client.stream("POST", url, content=job.body, headers=job.headers) as resp:
            # kvgate names the replica that served; other routers send nothing.
            replica = resp.headers.get("x-kvgate-replica")
            if resp.status_code != 200:
                await resp.aread()
                error = f"http_{resp.status_code}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    obj = orjson.loads(data)
                    if "error" in obj:
                        error = "stream_error"
                        break
                    if obj.get("usage"):
                        usage = obj["usage"]
                    if _has_text(obj, endpoint):
                        now = time.monotonic()
                        if first is None:
                            first = now
                        else:
                            gaps.append(now - (last or now))
                        last = now
                        chunks += 1
                if error is None and not done:
                    error = "incomplete_stream"
    except httpx.TimeoutException:
        error = "timeout"
    except httpx.TransportError:
        error = "transport_error"
    except orjson.JSONDecodeError:
        error = "bad_chunk"
    end = time.monotonic()
    prompt_tokens = int(usage.get("prompt_tokens", 0)) if usage else job.record.input_tokens
    output_tokens = int(usage.get("completion_tokens", chunks)) if usage else chunks
    cached: int | None = None
    if usage and isinstance(usage.get("prompt_tokens_details"), Mapping):
        value = usage["prompt_tokens_details"].get("cached_tokens")
        cached = int(value) if isinstance(value, int) else None
    return RequestResult(
        index=job.index,
        start_s=start - t0,
        end_s=end - t0,
        ttft_s=None if first is None else first - start,
        itl_s=tuple(gaps),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        cached_tokens=cached,
        error=error,
        replica=replica,
    )


def _has_text(obj: Mapping[str, Any], endpoint: Endpoint) -> bool:
    for choice in obj.get("choices") or ():
        if endpoint == "chat":
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
                return True
        elif choice.get("text"):
            return True
    return False


async def replay(
    requests: Trace | Sequence[TraceRecord],
    base_url: str | Sequence[str],
    *,
    block_tokens: int | None = None,
    speedup: float = 1.0,
    concurrency: int | None = None,
    model: str = DEFAULT_MODEL,
    endpoint: Endpoint = "chat",
    api_key: str | None = None,
    timeout_s: float = 600.0,
    ignore_eos: bool = True,
    max_output_tokens: int | None = None,
    headers: Mapping[str, str] | None = None,
    progress: TextIO | None = None,
    client: httpx.AsyncClient | None = None,
    layout: Layout = "growing",
    session_header: bool = True,
) -> ReplayReport:
    """Send every request of the trace and summarise what the endpoint did.

    `speedup` divides the trace's inter-arrival times (open loop); `concurrency` instead
    keeps that many requests in flight, ignoring arrival times (closed loop). Arrivals are
    relative to the first record. Pass `client` to reuse a connection pool.

    `layout` lays chat prompts out as one user message (``growing``) or one message per
    turn (``turns``, see `gateway.trace.render`). With `session_header`, each request's
    session (the trace's, else inferred from its prefixes) goes in ``x-session-id`` and
    ``x-smg-routing-key``; without it, requests carry no session at all.

    Several `base_url`s stand for router instances behind a client-side load balancer:
    request i goes to the i-th mod their number, so one conversation's turns reach
    different instances.
    """
    if isinstance(requests, Trace):
        records: Sequence[TraceRecord] = requests.records
        bt = block_tokens or requests.block_tokens
    else:
        records, bt = requests, block_tokens or 64
    if speedup <= 0:
        raise ValueError("speedup must be positive")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r} (known: {', '.join(LAYOUTS)})")
    if concurrency is not None and concurrency <= 0:
        raise ValueError("concurrency must be positive")
    bases = [base_url] if isinstance(base_url, str) else list(base_url)
    if not bases:
        raise ValueError("no base URL to send to")
    path = "/chat/completions" if endpoint == "chat" else "/completions"
    urls = [_v1(b) + path for b in bases]
    base_headers = {"content-type": "application/json", **(headers or {})}
    if api_key:
        base_headers["authorization"] = f"Bearer {api_key}"
    chat = endpoint == "chat"
    # Parents, segments and sessions: a pass over every block of the trace, off the loop
    # as prompts are. Every layout needs the parents (a turn extends its parent's text).
    renderer = await asyncio.to_thread(Renderer, PromptBuilder(bt), records, bt)

    def job(i: int, rec: TraceRecord) -> _Job:
        content = renderer.content(i, chat=chat, layout=layout)
        body = build_body(
            content,
            rec,
            model=model,
            endpoint=endpoint,
            ignore_eos=ignore_eos,
            max_output_tokens=max_output_tokens,
        )
        hdrs = dict(base_headers)
        if session_header:
            hdrs.update(session_headers(renderer.plans[i].session_id))
        return _Job(i, rec, orjson.dumps(body), hdrs)

    own = client is None
    http = client or httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
    )
    bar = _Progress(progress, len(records))
    results: list[RequestResult | None] = [None] * len(records)
    t0 = time.monotonic()

    async def run(i: int, rec: TraceRecord) -> None:
        bar.in_flight += 1
        started = time.monotonic() - t0
        try:
            # Building a 100K-token prompt takes milliseconds: keep it off the loop.
            j = job(i, rec) if rec.input_tokens < 8192 else await asyncio.to_thread(job, i, rec)
            res = await _one(http, urls[i % len(urls)], j, t0, endpoint)
        except Exception as exc:  # noqa: BLE001 - one request's boundary: count it, never drop it
            end = time.monotonic() - t0
            res = RequestResult(i, started, end, None, error=f"client_{type(exc).__name__}")
        finally:
            bar.in_flight -= 1
        results[i] = res
        bar.done += 1
        bar.errors += res.error is not None

    async def ticker() -> None:
        while True:
            bar.show()
            await asyncio.sleep(_PROGRESS_EVERY_S)

    tick = asyncio.create_task(ticker()) if progress is not None else None
    try:
        async with asyncio.TaskGroup() as tg:
            if concurrency is None:
                origin = records[0].arrival_s if records else 0.0
                for i, rec in enumerate(records):
                    delay = t0 + (rec.arrival_s - origin) / speedup - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    tg.create_task(run(i, rec))
            else:
                queue = iter(enumerate(records))

                async def worker() -> None:
                    for i, rec in queue:
                        await run(i, rec)

                for _ in range(min(concurrency, len(records))):
                    tg.create_task(worker())
    finally:
        if tick is not None:
            tick.cancel()
        if own:
            await http.aclose()
    duration = time.monotonic() - t0
    bar.show(final=True)
    done = [r for r in results if r is not None]
    return ReplayReport.build(done, duration, label="replay")
