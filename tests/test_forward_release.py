"""`open_leg` holds a replica's in-flight slot from the send to the leg's close, and gives it
back when the caller is cancelled before the leg exists (waiting for headers, or peeking
at a stream's first chunk)."""

from __future__ import annotations

import asyncio

import orjson

from gateway.forward import open_leg
from gateway.testing.servers import gateway, sim_engines
from gateway.types import ReplicaId

HEADERS = [(b"content-type", b"application/json")]


def _chat(stream: bool) -> bytes:
    return orjson.dumps(
        {
            "model": "kvgate-sim",
            "messages": [{"role": "user", "content": "hello " * 50}],
            "max_tokens": 4,
            "stream": stream,
        }
    )


async def test_cancelled_before_headers_or_first_chunk_releases_the_slot() -> None:
    async with (
        sim_engines(1, "tiny") as engines,
        gateway(engines, health={"interval_s": 60}) as gw,
    ):
        state, replica = gw.state, ReplicaId("e0")
        for stream in (False, True):
            task = asyncio.create_task(
                open_leg(
                    state.cluster,
                    state.client,
                    state.health,
                    replica,
                    "/v1/chat/completions",
                    HEADERS,
                    _chat(stream),
                )
            )
            await asyncio.sleep(0.001)
            assert state.cluster.in_flight[replica] == 1
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert state.cluster.in_flight[replica] == 0
        leg = await open_leg(
            state.cluster,
            state.client,
            state.health,
            replica,
            "/v1/chat/completions",
            HEADERS,
            _chat(True),
        )
        assert state.cluster.in_flight[replica] == 1
        await leg.aclose()
        assert state.cluster.in_flight[replica] == 0
