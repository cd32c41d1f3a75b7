"""What replay puts on the wire for each layout and session-header setting."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

import httpx
import orjson
import pytest

from gateway.sim.cluster import SimCluster
from gateway.trace.cli import register
from gateway.trace.format import Trace, TraceHeader, TraceRecord
from gateway.trace.generate import AgentTraceOptions, generate_agent_trace
from gateway.trace.render import SYSTEM_PROMPT, link_requests
from gateway.trace.replay import replay
from gateway.trace.stats import hit_rate

BT = 4
_SSE = (
    b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n'
    b"data: [DONE]\n\n"
)


def rec(t: float, hashes: tuple[int, ...], last: int = BT, sid: str | None = None) -> TraceRecord:
    return TraceRecord(t, (len(hashes) - 1) * BT + last, 1, hashes, last, sid)


# Two conversations without session ids; the second turn of each extends its first.
TRACE = Trace(
    TraceHeader(block_tokens=BT),
    (
        rec(0.0, (1, 2, 3)),
        rec(0.1, (7, 8), last=2),
        rec(0.2, (1, 2, 3, 4, 5)),
        rec(0.3, (7, 8, 9)),
    ),
)


class Recorder:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[httpx.Headers] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(orjson.loads(request.content))
        self.headers.append(request.headers)
        return httpx.Response(200, content=_SSE, headers={"content-type": "text/event-stream"})


async def send(trace: Trace, **kwargs: Any) -> Recorder:
    recorder = Recorder()
    async with httpx.AsyncClient(transport=httpx.MockTransport(recorder)) as client:
        report = await replay(trace, "http://engine", concurrency=1, client=client, **kwargs)
    assert report.errors == 0, report.error_kinds
    return recorder


async def test_turns_layout_extends_the_parent_messages() -> None:
    sent = await send(TRACE, layout="turns")
    msgs = [b["messages"] for b in sent.bodies]
    assert [len(m) for m in msgs] == [1, 1, 2, 2]
    assert msgs[2][:1] == msgs[0] and msgs[2][1]["role"] == "user"
    # Request 1 ends on a partial block: request 3 re-sends it whole, then goes on.
    assert msgs[3][:1] == msgs[1] and msgs[3][1]["role"] == "user"
    assert len(msgs[3][0]["content"] + msgs[3][1]["content"]) == 4 * TRACE.records[3].input_tokens
    assert all("user" not in b for b in sent.bodies)


async def test_sessions_are_inferred_and_sent_as_headers() -> None:
    sent = await send(TRACE)
    ids = [h["x-session-id"] for h in sent.headers]
    assert ids == [h["x-smg-routing-key"] for h in sent.headers]
    assert ids[0] == ids[2] != ids[1] == ids[3]
    assert [[m["role"] for m in b["messages"]] for b in sent.bodies] == [["system", "user"]] * 4
    assert sent.bodies[0]["messages"][0]["content"] == SYSTEM_PROMPT


async def test_known_sessions_are_kept_and_the_header_can_be_switched_off() -> None:
    named = Trace(
        TRACE.header, tuple(replace(r, session_id=f"s{i % 2}") for i, r in enumerate(TRACE.records))
    )
    sent = await send(named, endpoint="completions")
    assert [h["x-session-id"] for h in sent.headers] == ["s0", "s1", "s0", "s1"]
    assert all(isinstance(b["prompt"], str) and "messages" not in b for b in sent.bodies)
    quiet = await send(named, session_header=False, layout="turns")
    for body, headers in zip(quiet.bodies, quiet.headers):
        assert "user" not in body
        assert "x-session-id" not in headers and "x-smg-routing-key" not in headers


async def test_unknown_layout_fails_before_sending() -> None:
    with pytest.raises(ValueError, match="layout"):
        await send(TRACE, layout="flat")


def test_cli_layout_and_header_flags() -> None:
    parser = argparse.ArgumentParser(prog="kvgate")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["trace", "replay", "t.jsonl", "--url", "http://x"])
    assert (args.layout, args.no_session_header) == ("growing", False)
    flags = ["--layout", "turns", "--no-session-header"]
    args = parser.parse_args(["trace", "replay", "t.jsonl", "--url", "http://x", *flags])
    assert (args.layout, args.no_session_header) == ("turns", True)


async def test_turns_layout_keeps_the_trace_prefix_hits_on_an_engine() -> None:
    opts = AgentTraceOptions(seed=5, sessions=3, context_scale=0.02, block_tokens=16)
    trace = generate_agent_trace(opts).window(0, 24)
    links = link_requests(trace.records, trace.block_tokens)
    assert sum(link.parent is not None for link in links) >= 18
    async with SimCluster(1, time_scale=50.0) as cluster:
        report = await replay(trace, cluster.urls[0], concurrency=1, layout="turns")
    assert report.errors == 0, report.error_kinds
    assert report.hit_rate is not None
    # The engine's 16-token blocks and chat template cost a little.
    assert report.hit_rate >= hit_rate(trace) - 0.1
