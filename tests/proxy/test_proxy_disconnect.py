"""A client that leaves makes the engine abort: the upstream connection is closed at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.sim.server import SimEngine
from gateway.testing.servers import gateway, sim_engines

MODEL = "kvgate-sim"
LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "tell me everything"}],
    "max_tokens": 3000,
}


@pytest.fixture
async def engines() -> AsyncIterator[list[SimEngine]]:
    # Real decode steps (~20 ms per token): a 3000-token answer would take about a minute.
    async with sim_engines(1, "h200-sparse") as engines:
        yield engines


async def wait_for(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("client_kind", ["h1", "aiohttp", "httpx"])
async def test_mid_stream_disconnect_aborts_engine(
    engines: list[SimEngine], client_kind: str
) -> None:
    engine = engines[0]
    async with gateway(engines, upstream={"client": client_kind}) as gw:
        async with (
            httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
            http.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as resp,
        ):
            assert resp.status_code == 200
            got = 0
            async for chunk in resp.aiter_bytes():
                got += chunk.count(b"data:")
                if got >= 3:
                    break
            assert gw.state.cluster.in_flight["e0"] == 1
        # Leaving the block closed the client connection mid-stream.
        await wait_for(lambda: engine.aborted == 1)
        await wait_for(lambda: gw.state.cluster.in_flight["e0"] == 0)
        metrics = gw.state.metrics.render().decode()
        assert 'kvgate_client_disconnects_total{phase="mid_stream"} 1.0' in metrics


@pytest.mark.parametrize("client_kind", ["h1", "aiohttp", "httpx"])
async def test_disconnect_before_response_aborts_engine(
    engines: list[SimEngine], client_kind: str
) -> None:
    engine = engines[0]
    async with gateway(engines, upstream={"client": client_kind}) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=httpx.Timeout(10, read=0.5)) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(
                    "/v1/chat/completions", json=LONG
                )  # non-streaming: nothing until the end
        await wait_for(lambda: engine.aborted == 1)
        await wait_for(lambda: gw.state.cluster.in_flight["e0"] == 0)
        metrics = gw.state.metrics.render().decode()
        assert 'kvgate_client_disconnects_total{phase="before_response"} 1.0' in metrics
        # The gateway keeps serving afterwards.
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            ok = await http.post("/v1/chat/completions", json={**LONG, "max_tokens": 2})
            assert ok.status_code == 200
