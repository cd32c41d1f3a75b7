"""Issue 46: the console is already measuring when someone first opens it. With the token
metrics on (the default), the proxy builds an outcome per request anyway, so `measure:
auto` measures from start-up; traffic nobody watched shows on the first read."""

from __future__ import annotations

import httpx

from gateway.console.runtime import ConsoleRuntime
from gateway.testing.servers import gateway, sim_engines

BODY = {"model": "kvgate-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def test_traffic_before_the_first_read_is_on_the_first_read() -> None:
    async with (
        sim_engines(2, "instant") as engines,
        gateway(engines, console={"sample_interval_s": 0.05}) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        rt = gw.state.extras["console"]
        assert isinstance(rt, ConsoleRuntime)
        assert rt.watch.measuring and rt.measurements.observe in gw.state.observers
        for i in range(6):
            body = {**BODY, "stream": i % 2 == 0}
            resp = await http.post(
                "/v1/chat/completions", json=body, headers={"x-session-id": f"s{i % 3}"}
            )
            assert resp.status_code == 200
        # The first admin read of this gateway's life.
        traffic = (await http.get("/admin/traffic")).json()
        assert traffic["totals"]["requests"] == 6
        assert traffic["totals"]["completion"] == 6 * 3
        sessions = (await http.get("/admin/sessions")).json()
        assert sessions["live"] == 3
        fleet = (await http.get("/admin/fleet")).json()
        assert fleet["measuring"] is True
        assert any(r["ttft_p50_s"] is not None for r in fleet["replicas"])


async def test_auto_waits_for_a_reader_when_nothing_else_observes_requests() -> None:
    async with (
        sim_engines(1, "instant") as engines,
        gateway(engines, metrics={"tokens": False}) as gw,
    ):
        # No other observer: measuring would add outcome building and stream usage to every
        # request, so `auto` keeps to `watched` (nothing attached until a read).
        assert gw.state.observers == []


async def test_the_history_is_bounded() -> None:
    async with (
        sim_engines(1, "instant") as engines,
        gateway(engines, console={"sample_interval_s": 1.0, "history_s": 5.0}) as gw,
    ):
        rt = gw.state.extras["console"]
        for _ in range(20):
            rt.sampler.sample_once()
        assert len(rt.sampler) == 5
