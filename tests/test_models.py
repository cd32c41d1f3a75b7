from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.sim.profiles import PROFILES
from gateway.sim.server import SimEngine
from gateway.testing.servers import gateway, sim_engines
from gateway.types import ReplicaId


async def test_models_union_discovery_and_404_per_model() -> None:
    engines = [
        SimEngine(PROFILES["instant"], index=0, model_name="alpha"),
        SimEngine(PROFILES["instant"], index=1, model_name="beta"),
    ]
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
                    r = await http.post(
                        "/v1/chat/completions",
                        headers={"x-session-id": f"s{i}"},
                        json={
                            "model": "beta",
                            "messages": [{"role": "user", "content": "x"}],
                            "max_tokens": 1,
                        },
                    )
                    assert r.status_code == 200 and r.headers["x-kvgate-replica"] == "e1"
                r = await http.post(
                    "/v1/chat/completions",
                    json={"model": "gamma", "messages": [{"role": "user", "content": "x"}]},
                )
                assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
                # A replica that goes away drops out of /v1/models once the cache expires.
                state.cluster.set_healthy(ReplicaId("e0"), False)
                await asyncio.sleep(0.3)
                ids = sorted(m["id"] for m in (await http.get("/v1/models")).json()["data"])
                assert ids == ["beta"]
    finally:
        for e in engines:
            await e.stop()


async def test_engines_behind_an_api_key_are_discovered_with_the_gateways_own_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVGATE_UPSTREAM__ENGINE_API_KEY", "sk-engine")
    async with (
        sim_engines(2, "instant", model_name="alpha", api_key="sk-engine") as engines,
        gateway(engines) as gw,
    ):
        assert "sk-engine" not in repr(gw.state.settings)  # a secret, masked when shown
        # Discovery (GET /v1/models on each engine) needed the key: the model is known.
        assert gw.state.cluster.known_models() == {"alpha"}
        async with httpx.AsyncClient(base_url=gw.url) as http:
            listed = (await http.get("/v1/models")).json()["data"]
            assert [m["id"] for m in listed] == ["alpha"]
            chat = {
                "model": "alpha",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 1,
            }
            # Proxied requests carry the gateway's engine key, never the client's.
            bare = await http.post("/v1/chat/completions", json=chat)
            other = await http.post(
                "/v1/chat/completions", json=chat, headers={"authorization": "Bearer sk-client"}
            )
        assert bare.status_code == 200 and other.status_code == 200


async def test_the_client_authorization_passes_when_configured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVGATE_UPSTREAM__ENGINE_API_KEY", "sk-engine")
    async with (
        sim_engines(1, "instant", model_name="alpha", api_key="sk-engine") as engines,
        gateway(engines, upstream={"pass_client_authorization": True}) as gw,
        httpx.AsyncClient(base_url=gw.url) as http,
    ):
        chat = {"model": "alpha", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        ok = await http.post(
            "/v1/chat/completions", json=chat, headers={"authorization": "Bearer sk-engine"}
        )
        refused = await http.post("/v1/chat/completions", json=chat)
    assert ok.status_code == 200
    assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}


async def test_without_the_key_keyed_engines_serve_no_discovered_model() -> None:
    async with (
        sim_engines(1, "instant", model_name="alpha", api_key="sk-engine") as engines,
        gateway(engines) as gw,
    ):
        assert gw.state.cluster.known_models() is None  # discovery was refused
