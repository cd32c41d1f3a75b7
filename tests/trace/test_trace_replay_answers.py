"""How replay counts what an endpoint answers, against a stand-in OpenAI server on loopback
that streams exactly what the test scripts: an error chunk mid-stream, a chunk that is not
JSON, a stream cut before [DONE], a server slower than the timeout, usage with cached
tokens, the replica header kvgate sends; and the options replay refuses."""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import AsyncIterator

import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gateway.serving import start_server
from gateway.trace.format import Trace, TraceHeader, TraceRecord
from gateway.trace.replay import replay

BT = 16
TRACE = Trace(
    TraceHeader(block_tokens=BT),
    tuple(TraceRecord(0.01 * i, 2 * BT, 3, (1, 2 + i), BT, f"s{i}") for i in range(4)),
)


def chunk(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def text(t: str) -> bytes:
    return chunk({"choices": [{"index": 0, "delta": {"content": t}}]})


USAGE = chunk(
    {
        "choices": [],
        "usage": {
            "prompt_tokens": 40,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 16},
        },
    }
)
SCRIPTS: dict[str, list[bytes]] = {
    "ok": [text("a"), text("b"), text("c"), USAGE, b"data: [DONE]\n\n"],
    "error_chunk": [text("a"), chunk({"error": {"message": "engine died"}})],
    "not_json": [text("a"), b"data: {half\n\n"],
    "cut": [text("a"), text("b")],
    "no_usage": [b": keep-alive\n\n", text("a"), text("b"), b"data: [DONE]\n\n"],
}


class StandIn:
    def __init__(self) -> None:
        self.script = "ok"
        self.status = 200
        self.delay = 0.0
        self.bodies: list[dict[str, object]] = []
        self.headers: list[dict[str, str]] = []

    async def _chat(self, request: Request) -> Response:
        self.bodies.append(orjson.loads(await request.body()))
        self.headers.append(dict(request.headers))
        await asyncio.sleep(self.delay)
        if self.status != 200:
            return Response(b'{"error": {"message": "no"}}', status_code=self.status)
        parts = SCRIPTS[self.script]

        async def stream() -> AsyncIterator[bytes]:
            for part in parts:
                yield part

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"x-kvgate-replica": "r7"}
        )

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route(p, self._chat, methods=["POST"])
                for p in ("/v1/chat/completions", "/v1/completions")
            ]
        )


@contextlib.asynccontextmanager
async def stand_in() -> AsyncIterator[tuple[StandIn, str]]:
    engine = StandIn()
    server = await start_server(engine.app())
    try:
        yield engine, server.url
    finally:
        await server.stop()


async def test_a_clean_stream_is_timed_and_its_usage_read() -> None:
    progress = io.StringIO()
    async with stand_in() as (engine, url):
        report = await replay(TRACE, url, concurrency=2, api_key="k-1", progress=progress)
    assert (report.ok, report.errors) == (4, 0)
    for r in report.results:
        assert (r.prompt_tokens, r.output_tokens, r.cached_tokens) == (40, 3, 16)
        assert r.replica == "r7" and r.ttft_s is not None and len(r.itl_s) == 2
    assert report.hit_rate == pytest.approx(16 / 40)
    assert all(h["authorization"] == "Bearer k-1" for h in engine.headers)
    # The trace's own sessions travel as headers; each body asks for the trace's output.
    assert sorted(h["x-session-id"] for h in engine.headers) == ["s0", "s1", "s2", "s3"]
    assert all(b["max_tokens"] == 3 and b["ignore_eos"] is True for b in engine.bodies)
    assert "4/4 done, 0 in flight, 0 errors" in progress.getvalue()


@pytest.mark.parametrize(
    ("script", "kind"),
    [("error_chunk", "stream_error"), ("not_json", "bad_chunk"), ("cut", "incomplete_stream")],
)
async def test_broken_streams_are_errors_of_their_kind(script: str, kind: str) -> None:
    async with stand_in() as (engine, url):
        engine.script = script
        report = await replay(TRACE, url, concurrency=4)
    assert report.requests == 4 and report.ok == 0 and report.errors == 4
    assert dict(report.error_kinds) == {kind: 4}
    assert report.hit_rate is None


async def test_a_stream_without_usage_counts_its_chunks_and_the_trace_prompt() -> None:
    async with stand_in() as (engine, url):
        engine.script = "no_usage"
        report = await replay(TRACE, url, concurrency=1, ignore_eos=False)
    assert report.ok == 4
    # No usage: the prompt is the trace's, the output what was streamed, no cache figure.
    assert [(r.prompt_tokens, r.output_tokens, r.cached_tokens) for r in report.results] == [
        (32, 2, None)
    ] * 4
    assert all("ignore_eos" not in b and "messages" in b for b in engine.bodies)


async def test_statuses_and_timeouts() -> None:
    async with stand_in() as (engine, url):
        engine.status = 429
        busy = await replay(TRACE, url, concurrency=4, max_output_tokens=1)
        assert dict(busy.error_kinds) == {"http_429": 4}
        assert all(b["max_tokens"] == 1 for b in engine.bodies)  # capped from 3
        engine.status, engine.delay = 200, 0.4
        slow = await replay(TRACE, url, concurrency=4, timeout_s=0.1)
    assert dict(slow.error_kinds) == {"timeout": 4} and slow.ok == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"speedup": 0}, "speedup must be positive"),
        ({"concurrency": 0}, "concurrency must be positive"),
        ({"layout": "spiral"}, "unknown layout 'spiral'"),
        ({"base_url": []}, "no base URL to send to"),
    ],
)
async def test_options_replay_refuses(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"base_url": "http://127.0.0.1:9", **kwargs}
    with pytest.raises(ValueError, match=message):
        await replay(TRACE, **args)  # type: ignore[arg-type]
