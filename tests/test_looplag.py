"""`kvgate_event_loop_lag_seconds` over a real server: idle, then with the loop held."""

from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import build_app
from gateway.serving import start_server
from gateway.settings import load_settings


def _lag(text: str) -> dict[str, float]:
    """Bucket bound -> cumulative count, plus `count`."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "kvgate_event_loop_lag_seconds":
            continue
        for s in family.samples:
            if s.name.endswith("_bucket"):
                out[s.labels["le"]] = s.value
            elif s.name.endswith("_count"):
                out["count"] = s.value
    return out


async def test_loop_lag_counts_wakeups_and_sees_a_held_loop() -> None:
    app = build_app(load_settings(sim={"replicas": 1, "profile": "instant"}))
    server = await start_server(app)
    try:
        async with httpx.AsyncClient(base_url=server.url) as http:
            # At least three wake-ups idle (0.3 s on a quiet host; a busy CI host may need more).
            for _ in range(50):
                await asyncio.sleep(0.1)
                idle = _lag((await http.get("/metrics")).text)
                if idle.get("count", 0) >= 3:
                    break
            # The test shares the server's loop: holding it delays the timer's wake-up.
            time.sleep(0.3)
            await asyncio.sleep(0.1)
            held = _lag((await http.get("/metrics")).text)
    finally:
        await server.stop()
    assert idle["count"] >= 3
    slow_idle = idle["count"] - idle["0.1"]
    slow_held = held["count"] - held["0.1"]
    assert slow_held >= slow_idle + 1  # the wake-up that fell in the 0.3 s hold
