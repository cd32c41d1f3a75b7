"""The fleet panel over HTTP while requests run: its in-flight counts are the gateway's
(each request counted once, on the replica that serves it) and fall back to zero when the
requests end, whether they finish or the client walks away mid-stream."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from tests.console.test_guard import console_over_http


async def fleet(http: httpx.AsyncClient) -> dict[str, Any]:
    resp = await http.get("/admin/fleet")
    assert resp.status_code == 200
    body: dict[str, Any] = resp.json()
    return body


async def until(http: httpx.AsyncClient, check: Any, timeout: float = 5.0) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        body = await fleet(http)
        if check(body) or loop.time() > deadline:
            return body
        await asyncio.sleep(0.02)


def chat(session: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "kvgate-sim",
        "messages": [{"role": "user", "content": f"conversation {session}"}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }


async def test_in_flight_follows_open_streams_and_returns_to_zero_when_clients_leave() -> None:
    # A slow engine clock: 900-token streams last well past the reads below.
    async with console_over_http(engines=2, time_scale=0.05) as http:
        idle = await fleet(http)
        assert idle["in_flight"] == 0 and idle["healthy"] == 2
        assert abs(sum(r["ring_share"] for r in idle["replicas"]) - 1.0) < 0.01
        streams = [
            http.stream(
                "POST",
                "/v1/chat/completions",
                json=chat(f"s{i}", 900),
                headers={"x-session-id": f"s{i}"},
            )
            for i in range(4)
        ]
        opened = [await s.__aenter__() for s in streams]
        served: dict[str, int] = {}
        # Held: an async generator dropped is closed by asyncio, and its stream with it.
        readers = [resp.aiter_raw() for resp in opened]
        for resp in opened:
            assert resp.status_code == 200
            served[resp.headers["x-kvgate-replica"]] = (
                served.get(resp.headers["x-kvgate-replica"], 0) + 1
            )
        for reader in readers:
            await reader.__anext__()  # the first event: the request is on the engine
        busy = await fleet(http)
        assert busy["in_flight"] == 4
        assert {r["id"]: r["in_flight"] for r in busy["replicas"] if r["in_flight"]} == served
        # Two clients walk away mid-stream; the gateway must notice and release their slots.
        for s in streams[:2]:
            await s.__aexit__(None, None, None)
        half = await until(http, lambda b: b["in_flight"] == 2)
        assert half["in_flight"] == 2
        for s in streams[2:]:
            await s.__aexit__(None, None, None)
        done = await until(http, lambda b: b["in_flight"] == 0)
        assert done["in_flight"] == 0
        assert all(r["in_flight"] == 0 for r in done["replicas"])


async def test_requests_that_finish_leave_nothing_in_flight() -> None:
    async with console_over_http(engines=2) as http:
        body = {**chat("done", 8), "stream": False}
        replies = await asyncio.gather(
            *(http.post("/v1/chat/completions", json=body) for _ in range(6))
        )
        assert [r.status_code for r in replies] == [200] * 6
        after = await fleet(http)
        assert after["in_flight"] == 0
        assert all(r["in_flight"] == 0 and r["healthy"] for r in after["replicas"])
