"""No silent collapse without engine metrics (issue 44): SGLang serves `/metrics` only with
`--enable-metrics`. A replica whose `/metrics` answers 404 is judged by the gateway's own
in-flight and token counts, with one warning and `kvgate_replica_engine_load_missing`, and
with admission on it still runs requests concurrently (before: one at a time)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest

from gateway.serving import start_server
from gateway.sim.profiles import PROFILES
from gateway.sim.server import SimEngine
from gateway.testing.servers import gateway

CHAT = "/v1/chat/completions"


class NoMetrics:
    """ASGI wrapper: `/metrics` is a 404 (SGLang's default) and chat concurrency is counted."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.running = 0
        self.most = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/metrics":
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b'{"detail":"Not Found"}'})
            return
        if scope["type"] != "http" or scope["path"] != CHAT:
            await self.app(scope, receive, send)
            return
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await self.app(scope, receive, send)
        finally:
            self.running -= 1


async def test_admission_on_metrics_off_still_runs_requests_concurrently(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = SimEngine(PROFILES["tiny"], index=0)
    wrapped = NoMetrics(engine.app)
    engine.server = await start_server(wrapped, "127.0.0.1", 0)
    try:
        with caplog.at_level(logging.WARNING):
            async with (
                gateway(
                    [engine],
                    admission={"enabled": True},
                    scrape={"interval_s": 0.1, "stale_after_s": 1.0},
                    health={"interval_s": 60},
                    models={"discover": False},
                ) as gw,
                httpx.AsyncClient(base_url=gw.url, timeout=30) as http,
            ):
                for _ in range(50):  # the first scrape has answered 404
                    text = (await http.get("/metrics")).text
                    if 'kvgate_replica_engine_load_missing{replica="e0"} 1.0' in text:
                        break
                    await asyncio.sleep(0.1)
                assert 'kvgate_replica_engine_load_missing{replica="e0"} 1.0' in text

                async def ask(i: int) -> int:
                    body = {
                        "model": "kvgate-sim",
                        "messages": [{"role": "user", "content": f"q{i}"}],
                        "max_tokens": 16,
                    }
                    return (await http.post(CHAT, json=body)).status_code

                got = await asyncio.gather(*(ask(i) for i in range(8)))
                await asyncio.sleep(0.3)  # a few more 404 scrapes: still one warning
                assert gw.state.cluster.is_healthy(next(iter(gw.state.cluster.members)))
    finally:
        await engine.stop()
    assert got == [200] * 8
    assert wrapped.most >= 4, wrapped.most  # one at a time before issue 44
    warnings = [r for r in caplog.records if "exposes no engine load" in r.getMessage()]
    assert len(warnings) == 1 and "--enable-metrics" in warnings[0].getMessage()
