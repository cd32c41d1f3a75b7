from __future__ import annotations

import asyncio

import httpx

from gateway.sim.profiles import PROFILES
from gateway.sim.server import SimEngine
from gateway.testing.servers import gateway
from gateway.types import ReplicaId


async def test_models_union_discovery_and_404_per_model() -> None:
    engines = [SimEngine(PROFILES["instant"], index=0, model_name="alpha"),
               SimEngine(PROFILES["instant"], index=1, model_name="beta")]
    for e in engines:
        await e.start()
    try:
        async with gateway(engines, models={"cache_ttl_s": 0.2, "refresh_s": 0.1}) as gw:
            state = gw.state
            assert state.cluster.known_models() == {"alpha", "beta"}
            async with httpx.AsyncClient(base_url=gw.url) as http:
                ids = sorted(m["id"] for m in (await http.get("/v1/models")).json()["data"])
                assert ids == ["alpha", "beta"]
                # Each model goes only to the replica serving it, whatever the session.
                for i in range(6):
                    r = await http.post("/v1/chat/completions", headers={"x-session-id": f"s{i}"},
                                        json={"model": "beta", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
                    assert r.status_code == 200 and r.headers["x-kvgate-replica"] == "e1"
                r = await http.post("/v1/chat/completions", json={"model": "gamma", "messages": [{"role": "user", "content": "x"}]})
                assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
                # A replica that goes away drops out of /v1/models once the cache expires.
                state.cluster.set_healthy(ReplicaId("e0"), False)
                await asyncio.sleep(0.3)
                ids = sorted(m["id"] for m in (await http.get("/v1/models")).json()["data"])
                assert ids == ["beta"]
    finally:
        for e in engines:
            await e.stop()
