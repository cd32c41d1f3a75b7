"""`kvgate sim --api-key`: the fault and reset endpoints need the key too."""

from __future__ import annotations

import httpx

from gateway.testing.servers import sim_engines


async def test_fault_and_reset_endpoints_need_the_key() -> None:
    async with (
        sim_engines(1, "instant", api_key="sk-sim") as (engine,),
        httpx.AsyncClient(base_url=engine.url) as http,
    ):
        assert (await http.get("/admin/faults")).status_code == 401
        assert (await http.post("/reset_prefix_cache")).status_code == 401
        keyed = {"authorization": "Bearer sk-sim"}
        assert (await http.get("/admin/faults", headers=keyed)).status_code == 200
        assert (await http.post("/reset_prefix_cache", headers=keyed)).status_code == 200
        assert (await http.get("/health")).status_code == 200
