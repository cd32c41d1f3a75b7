"""The console at laptop widths in a real headless Chromium: from 1280 px wide nothing is
clipped (every panel's content fits its box, the page does not scroll sideways), and the
per-replica error share shows the engine that fails a fifth of its requests."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from console_rig import Load, console_gateway
from test_console_browser import CHROMEDRIVER, CHROMIUM, RESULTS, eventually

from gateway.sim.faults import FaultConfig
from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway

webdriver = pytest.importorskip("selenium.webdriver")

# Each element whose content is wider than its box, as "selector: content > box".
CLIPPED = """
const out = [];
const name = (e) => e.id ? '#' + e.id : e.tagName.toLowerCase() + '.' + e.className;
for (const e of document.querySelectorAll('.panel, .panel .scroll, header, .kpi')) {
  if (e.scrollWidth > e.clientWidth + 1) out.push(`${name(e)}: ${e.scrollWidth} > ${e.clientWidth}`);
}
const doc = document.documentElement;
if (doc.scrollWidth > window.innerWidth) out.push(`page: ${doc.scrollWidth} > ${window.innerWidth}`);
return out;
"""


def _browser(width: int, height: int) -> Any:
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument(f"--window-size={width},{height}")
    options.binary_location = CHROMIUM or ""
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
    )
    return driver


@pytest.fixture
async def failing_fleet() -> AsyncIterator[tuple[RunningGateway, list[SimEngine]]]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        if os.environ.get("KVGATE_REQUIRE_BROWSER"):
            pytest.fail("chromium / chromedriver not found on PATH")
        pytest.skip("chromium and chromedriver not found (apt install chromium chromium-driver)")
    async with console_gateway() as (gw, engines):
        # fast-0 answers a fifth of its requests 503; the gateway retries them elsewhere.
        await engines[0].set_faults(FaultConfig(error=503, error_rate=0.2))
        yield gw, engines


@pytest.mark.parametrize("width", [1280, 1440])
async def test_nothing_is_clipped_from_1280_px_and_errors_show_per_replica(
    failing_fleet: tuple[RunningGateway, list[SimEngine]], width: int
) -> None:
    gw, _ = failing_fleet
    load = Load(gw.url)
    load.start()
    driver = await asyncio.to_thread(_browser, width, 900)
    http = httpx.AsyncClient(base_url=gw.url, timeout=10)

    async def js(script: str) -> Any:
        return await asyncio.to_thread(driver.execute_script, script)

    try:
        await asyncio.sleep(3)  # traffic before anyone opens the page
        await asyncio.to_thread(driver.get, gw.url + "/console")

        async def failing_shown() -> str | None:
            cell = await js(
                "const c = document.querySelector(\"#fleet-rows tr[data-replica='fast-0'] .err\");"
                "return c && [c.textContent, c.classList.contains('bad')]"
            )
            if not cell or cell[0] in ("–", "0.0%"):
                return f"fast-0 errors cell {cell}"
            return None

        await eventually(failing_shown, 15)
        fleet = (await http.get("/admin/fleet")).json()
        shares = {r["id"]: r["error_share"] for r in fleet["replicas"]}
        # Failed attempts over attempts in the last minute: about 0.2 on fast-0 (the pool
        # controller steers traffic away from it, so few attempts: wide bounds), none on
        # the engines without a fault.
        assert shares["fast-0"] is not None and 0.02 < shares["fast-0"] < 0.6, shares
        assert all(shares[r] in (None, 0.0) for r in ("cheap-0", "cheap-1")), shares
        # Measuring already ran before the page opened: tokens and sessions on first sight.
        assert (await js("return document.querySelector('#kpi-tps').textContent")) != "–"
        assert fleet["measuring"] is True

        clipped = await js(CLIPPED)
        RESULTS.mkdir(parents=True, exist_ok=True)
        shot = RESULTS / f"console-{width}.png"
        await asyncio.to_thread(driver.save_screenshot, str(shot))
        assert not clipped, clipped
    finally:
        await load.stop()
        await http.aclose()
        await asyncio.to_thread(driver.quit)
