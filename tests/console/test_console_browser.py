"""The console in a real headless Chromium (selenium + chromedriver) against a gateway on
simulated engines under load: no console errors, panels agree with the admin JSON, a
replica killed mid-test turns `ejected` on the page within seconds, and a 1920x1080
screenshot lands in loadtests/results/console.png."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from console_rig import Load, console_gateway

from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway

webdriver = pytest.importorskip("selenium.webdriver")

RESULTS = Path(__file__).resolve().parents[2] / "loadtests" / "results"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
# Seconds from the kill to the page showing `ejected`: probes every 0.25 s (two failures),
# one page poll (1.5 s) and rendering, with room for a busy 2-core machine.
EJECT_DEADLINE_S = 6.0


def _browser() -> Any:
    options = webdriver.ChromeOptions()
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1920,1080",
    ):
        options.add_argument(arg)
    options.binary_location = CHROMIUM or ""
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    from selenium.webdriver.chrome.service import Service

    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    # The viewport itself is 1920x1080 (a wall screen), not the window around it.
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": 1920, "height": 1080, "deviceScaleFactor": 1, "mobile": False},
    )
    return driver


@pytest.fixture
async def rig() -> AsyncIterator[tuple[RunningGateway, list[SimEngine], Any]]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        if os.environ.get("KVGATE_REQUIRE_BROWSER"):
            pytest.fail("chromium / chromedriver not found on PATH")
        pytest.skip(
            "chromium and chromedriver not found (CI installs them; apt install chromium chromium-driver)"
        )
    async with console_gateway() as (gw, engines):
        driver = await asyncio.to_thread(_browser)
        try:
            yield gw, engines, driver
        finally:
            await asyncio.to_thread(driver.quit)


async def eventually(check: Callable[[], Awaitable[str | None]], timeout: float) -> float:
    """Retry `check` (None = passed, else why not) until it passes; returns seconds taken."""
    started = time.monotonic()
    why: str | None = "never ran"
    while time.monotonic() - started < timeout:
        why = await check()
        if why is None:
            return time.monotonic() - started
        await asyncio.sleep(0.2)
    raise AssertionError(f"not within {timeout} s: {why}")


def pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


async def test_console_in_a_real_browser(
    rig: tuple[RunningGateway, list[SimEngine], Any],
) -> None:
    gw, engines, driver = rig
    load = Load(gw.url)
    load.start()
    http = httpx.AsyncClient(base_url=gw.url, timeout=10)

    async def js(script: str) -> Any:
        return await asyncio.to_thread(driver.execute_script, script)

    async def text(selector: str) -> str:
        return str(await js(f"return document.querySelector({selector!r})?.textContent ?? null"))

    try:
        await asyncio.to_thread(driver.get, gw.url + "/console")

        async def has_data() -> str | None:
            rows = await js("return document.querySelectorAll('#fleet-rows tr').length")
            tps = await text("#traffic-tps")
            return None if rows == 4 and tps not in ("–", "0") else f"rows={rows} tps={tps}"

        await eventually(has_data, 10)

        # Cached tokens reported against predicted: the page shows the API's totals. (This
        # load's prompts are shorter than one routing block: nothing is predicted, while
        # the engines, with 16-token blocks, report hits.)
        async def forecast_shown() -> str | None:
            shown = await text("#traffic-forecast")
            return None if " / " in shown else f"forecast shows {shown}"

        await eventually(forecast_shown, 10)
        forecast = (await http.get("/admin/traffic")).json()["cache_forecast"]
        assert forecast is not None and forecast["achieved_tokens"] > 0
        reported, predicted = (await text("#traffic-forecast")).split(" / ")
        assert reported not in ("0", "–") and predicted == "0"

        # -- a replica dies under load: the page says so within seconds ---------------
        killed = "fast-1"
        await engines[1].stop()
        health = f"#fleet-rows tr[data-replica={killed!r}]"

        async def ejected() -> str | None:
            state = await js(f"return document.querySelector({health!r}).dataset.health")
            return None if state == "ejected" else f"{killed} shows {state}"

        took = await eventually(ejected, EJECT_DEADLINE_S)
        print(f"{killed} shown ejected {took:.1f} s after the kill")
        events = await text("#timeline-events")
        assert f"ejected {killed}" in events, events

        RESULTS.mkdir(parents=True, exist_ok=True)
        shot = RESULTS / "console.png"
        await asyncio.sleep(2)  # a few more samples in the charts after the kill
        assert await asyncio.to_thread(driver.save_screenshot, str(shot))
        assert shot.stat().st_size > 50_000  # a drawn page, not a blank one
        await load.stop()
        assert load.statuses.get(200, 0) > 50, load.statuses

        # -- every panel agrees with the admin JSON once the load stopped --------------
        async def panels_match() -> str | None:
            fleet = (await http.get("/admin/fleet")).json()
            for r in fleet["replicas"]:
                row = f"#fleet-rows tr[data-replica={r['id']!r}]"
                shown = await js(
                    f"const r = document.querySelector({row!r}); return r && [r.dataset.health, "
                    "r.querySelector('.engine').textContent, r.querySelector('.pool').textContent, "
                    "r.querySelector('.ring').textContent, r.querySelector('.inflight').textContent]"
                )
                want = [
                    r["health"],
                    r["engine"],
                    r["pool"],
                    pct(r["ring_share"]),
                    str(r["in_flight"]),
                ]
                if shown != want:
                    return f"fleet row {r['id']}: page {shown} vs JSON {want}"
            healthy = await text("#kpi-healthy")
            if healthy != f"{fleet['healthy']} / {len(fleet['replicas'])}":
                return f"healthy KPI {healthy} vs {fleet['healthy']}"
            sessions = (await http.get("/admin/sessions")).json()
            if await text("#sessions-tracked") != str(sessions["tracked"]):
                return (
                    f"sessions tracked {await text('#sessions-tracked')} vs {sessions['tracked']}"
                )
            if await text("#sessions-moves") != str(sum(sessions["moves"].values())):
                return f"moves {await text('#sessions-moves')} vs {sessions['moves']}"
            for rid, n in sessions["spread"].items():
                bar = await text(f"#sessions-spread .bar[data-replica={rid!r}] b")
                if bar != str(n):
                    return f"spread {rid}: {bar} vs {n}"
            traffic = (await http.get("/admin/traffic")).json()
            money = traffic["money"]
            for pool, weight in money["weights"].items():
                cell = await text(f"#money-rows tr[data-pool={pool!r}] td:nth-child(2)")
                if cell != pct(weight):
                    return f"weight {pool}: {cell} vs {weight}"
            if money["last_change"]["reason"] not in await text("#money-reason"):
                return "controller reason differs"
            admission = (await http.get("/admin/admission")).json()
            for c in admission["classes"]:
                row = f"#admission-rows tr[data-class={c['name']!r}]"
                shown = await js(
                    f"const r = document.querySelector({row!r}); return r && ["
                    "r.querySelector('.waits').textContent, r.querySelector('.full').textContent, "
                    "r.querySelector('.timeout').textContent]"
                )
                want = [
                    str(c["waits"]),
                    str(c["rejected"]["queue_full"]),
                    str(c["rejected"]["timeout"]),
                ]
                if shown != want:
                    return f"admission {c['name']}: page {shown} vs JSON {want}"
            pd = (await http.get("/admin/pd")).json()
            pd_rows = await js(
                "return document.querySelectorAll('#pd-rows tr[data-reason]').length"
            )
            if pd_rows != len(pd["decisions"]):
                return f"pd rows {pd_rows} vs {len(pd['decisions'])}"
            return None

        await eventually(panels_match, 8)
        totals = (await http.get("/admin/traffic")).json()["totals"]
        assert totals["requests"] > 50 and totals["completion"] > 0, totals

        logs = await asyncio.to_thread(driver.get_log, "browser")
        errors = [entry for entry in logs if entry["level"] in ("SEVERE", "ERROR")]
        assert not errors, errors
    finally:
        await load.stop()
        await http.aclose()
