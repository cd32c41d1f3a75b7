"""The console's admin JSON, its sampler and its watch, against real gateways on loopback."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest
from starlette.requests import Request

from gateway.app import build_app
from gateway.console.config import ConsoleSettings, console_url
from gateway.console.guard import admin_guard
from gateway.console.runtime import ConsoleRuntime
from gateway.errors import ConfigError
from gateway.settings import load_settings
from gateway.testing.servers import RunningGateway, gateway, sim_engines

BODY = {"model": "kvgate-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def runtime(gw: RunningGateway) -> ConsoleRuntime:
    rt = gw.state.extras["console"]
    assert isinstance(rt, ConsoleRuntime)
    return rt


async def chat(http: httpx.AsyncClient, n: int, **extra: Any) -> None:
    for i in range(n):
        body = {**BODY, **extra}
        resp = await http.post(
            "/v1/chat/completions", json=body, headers={"x-session-id": f"s{i % 3}"}
        )
        assert resp.status_code == 200, resp.text
        if body.get("stream"):
            assert resp.text.rstrip().endswith("data: [DONE]")
            assert '"usage":{' not in resp.text  # asked for by the gateway, not shown


async def test_nobody_watching_means_no_observer_and_the_first_read_starts_measuring() -> None:
    # With the token metrics off (metrics.tokens), the console is the only observer there is.
    async with (
        sim_engines(2, "instant") as engines,
        gateway(
            engines,
            # Unread for 3 s detaches: ten times what the reads below take on a loaded
            # 2-core machine (at 0.3 s the observer left mid-test there and counted nothing).
            # Unwatched, the sampler ticks at its idle interval (10 s by default), and the
            # detach below happens on a tick: at the default the wait took 14 of its 15 s.
            console={
                "sample_interval_s": 0.05,
                "idle_sample_interval_s": 0.05,
                "watch_idle_s": 3.0,
            },
            metrics={"tokens": False},
        ) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        rt = runtime(gw)
        await chat(http, 4)
        # The request path ran exactly as without a console: no outcome observer at all.
        assert gw.state.observers == []
        assert rt.measurements.tallies == {}
        traffic = (await http.get("/admin/traffic")).json()
        assert traffic["totals"] == {"requests": 0, "prompt": 0, "cached": 0, "completion": 0}
        assert gw.state.observers == [rt.measurements.observe]
        await chat(http, 6)
        await chat(http, 2, stream=True)
        traffic = (await http.get("/admin/traffic")).json()
        totals = traffic["totals"]
        assert totals["requests"] == 8
        # Streamed requests report usage too: the gateway asked the engine for it.
        assert totals["completion"] == 8 * 3 and totals["prompt"] > 0
        fleet = (await http.get("/admin/fleet")).json()
        served = [r for r in fleet["replicas"] if r["ttft_p50_s"] is not None]
        assert served and all(0 < r["ttft_p50_s"] <= r["ttft_p99_s"] for r in served)
        sessions = (await http.get("/admin/sessions")).json()
        assert sessions["live"] == sessions["tracked"] == 3
        assert sum(sessions["spread"].values()) == 3
        assert {h["requests"] for h in sessions["hottest"]} <= {2, 3, 4}
        assert sum(h["requests"] for h in sessions["hottest"]) == 8
        # Unread for watch_idle_s: the next sampler tick detaches the observer.
        for _ in range(300):
            await asyncio.sleep(0.05)
            if not gw.state.observers:
                break
        assert gw.state.observers == []


async def test_measure_off_never_attaches_and_always_attaches_at_once() -> None:
    async with sim_engines(1, "instant") as engines:
        async with gateway(engines, console={"measure": "off"}, metrics={"tokens": False}) as gw:
            async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
                assert (await http.get("/admin/fleet")).json()["measuring"] is False
            assert gw.state.observers == []
        async with gateway(engines, console={"measure": "always"}, metrics={"tokens": False}) as gw:
            assert gw.state.observers == [runtime(gw).measurements.observe]
        assert gw.state.observers == []  # stopped with the app


async def test_fleet_history_and_rates_follow_the_traffic() -> None:
    async with (
        sim_engines(2, "instant") as engines,
        gateway(engines, console={"sample_interval_s": 0.05, "history_s": 0.25}) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        fleet = (await http.get("/admin/fleet")).json()
        assert [r["id"] for r in fleet["replicas"]] == ["e0", "e1"]
        assert {r["health"] for r in fleet["replicas"]} == {"healthy"}
        assert {r["engine"] for r in fleet["replicas"]} <= {"vllm", "unknown"}
        assert sum(r["ring_share"] for r in fleet["replicas"]) == pytest.approx(1.0, abs=1e-3)
        await chat(http, 20)
        rt = runtime(gw)

        def counted() -> float:
            return sum(v for k, v in rt.sampler.series["kvgate_requests_total"].items())

        # Wait for a sampler tick after the traffic (a fixed sleep missed it under load).
        for _ in range(200):
            await asyncio.sleep(0.05)
            if counted() == 20:
                break
        samples = (await http.get("/admin/history")).json()
        # Bounded: history_s / sample_interval_s samples at most.
        assert 1 <= len(samples) <= 5
        assert all(set(s["replicas"]) == {"e0", "e1"} for s in samples)
        # `since` returns only what is newer; the sampler may have added one since.
        last = samples[-1]["t"]
        newer = (await http.get(f"/admin/history?since={last}")).json()
        assert all(s["t"] > last for s in newer)
        after_first = (await http.get(f"/admin/history?since={samples[0]['t']}")).json()
        assert all(s["t"] > samples[0]["t"] for s in after_first)
        assert len(after_first) >= len(samples) - 1
        bad = await http.get("/admin/history?since=yesterday")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"
        # requests/s is read back from kvgate_requests_total: 20 requests were counted.
        assert counted() == 20


async def test_a_dead_replica_is_ejected_on_the_fleet_and_on_the_timeline() -> None:
    async with (
        sim_engines(2, "instant") as engines,
        gateway(
            engines,
            health={"interval_s": 0.05, "failure_threshold": 1, "cooldown_s": 30},
            console={"sample_interval_s": 0.05},
        ) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        await engines[1].stop()
        # An idle replica is probed every health.idle_interval_s (4 s): out within that.
        deadline = asyncio.get_running_loop().time() + 15
        while asyncio.get_running_loop().time() < deadline:
            fleet = (await http.get("/admin/fleet")).json()
            if fleet["healthy"] == 1:
                break
            await asyncio.sleep(0.05)
        rows = {r["id"]: r for r in fleet["replicas"]}
        assert rows["e1"]["health"] == "ejected" and rows["e1"]["ring_share"] == 0
        assert rows["e0"]["ring_share"] == pytest.approx(1.0)
        assert [(e["kind"], e["subject"]) for e in fleet["events"]] == [("ejected", "e1")]
        for _ in range(200):  # the next sampler tick records it, however late under load
            last = (await http.get("/admin/history")).json()[-1]
            if last["replicas"]["e1"]["health"] == "ejected":
                break
            await asyncio.sleep(0.05)
        assert last["replicas"]["e1"]["health"] == "ejected"


async def test_pages_and_assets_are_served_under_the_configured_path() -> None:
    async with (
        sim_engines(1, "instant") as engines,
        gateway(engines, console={"path": "/ops/console"}) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        page = await http.get("/ops/console")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert 'src="/ops/console/console.js"' in page.text and "{{base}}" not in page.text
        js = await http.get("/ops/console/console.js")
        assert js.status_code == 200 and "javascript" in js.headers["content-type"]
        assert (await http.get("/ops/console/console.css")).status_code == 200
        assert (await http.get("/console")).status_code == 404
        assert (await http.post("/admin/fleet")).status_code == 405  # read only


async def test_the_console_can_be_switched_off() -> None:
    async with (
        sim_engines(1, "instant") as engines,
        gateway(engines, console={"enabled": False}) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        assert "console" not in gw.state.extras
        assert (await http.get("/admin/fleet")).status_code == 404
        assert (await http.get("/console")).status_code == 404


def _request(host: str) -> Request:
    return Request(
        {
            "type": "http",
            "method": "GET",
            "path": "/admin/fleet",
            "headers": [],
            "client": (host, 50000),
            "query_string": b"",
        }
    )


def test_admin_guard_lets_everything_through_unless_local_only() -> None:
    assert admin_guard(_request("10.1.2.3"), ConsoleSettings()) is None
    local_only = ConsoleSettings(local_only=True)
    assert admin_guard(_request("127.0.0.1"), local_only) is None
    assert admin_guard(_request("::1"), local_only) is None
    denied = admin_guard(_request("10.1.2.3"), local_only)
    assert denied is not None and denied.status_code == 403
    assert orjson.loads(bytes(denied.body))["error"]["type"] == "permission_error"


@pytest.mark.parametrize(
    "bad",
    [
        {"path": "console"},
        {"path": "/console/"},
        {"path": "/v1/console"},
        {"history_s": 1, "sample_interval_s": 2},
        {"measure": "sometimes"},
    ],
)
def test_bad_console_settings_fail_start_up(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as err:
        build_app(load_settings(console=bad))
    assert "console" in err.value.message


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("0.0.0.0", "http://127.0.0.1:8000/console"),
        ("::", "http://[::1]:8000/console"),
        ("10.0.0.7", "http://10.0.0.7:8000/console"),
    ],
)
def test_console_url(host: str, url: str) -> None:
    assert console_url(host, 8000, "/console") == url


async def test_traffic_shows_reported_against_predicted_cache_hits() -> None:
    system = "You answer questions about the Quillfeather archive. " * 150
    async with (
        sim_engines(2, "instant") as engines,
        gateway(engines) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        assert (await http.get("/admin/traffic")).json()["cache_forecast"] is None
        reported = 0
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
        for turn in range(4):
            resp = await http.post(
                "/v1/chat/completions",
                json={"model": "kvgate-sim", "messages": messages, "max_tokens": 2},
            )
            assert resp.status_code == 200, resp.text
            answer = resp.json()
            reported += answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            messages += [answer["choices"][0]["message"], {"role": "user", "content": f"{turn}?"}]
        forecast = (await http.get("/admin/traffic")).json()["cache_forecast"]
        assert forecast["requests"] == 4
        assert forecast["achieved_tokens"] == reported > 0
        assert forecast["best_tokens"] >= forecast["predicted_tokens"] > 0
        assert forecast["achieved_over_predicted"] == pytest.approx(
            reported / forecast["predicted_tokens"], abs=1e-4
        )
