"""The gateway's own routes and SIGHUP's replica reload, on a real server in front of
simulated engines."""

from __future__ import annotations

import httpx
import openai
import pytest

from gateway.app import reload_replicas
from gateway.settings import load_settings
from gateway.testing.servers import gateway, replica_config, sim_engines


async def test_ready_follows_health_and_draining() -> None:
    async with (
        sim_engines(1, "instant") as engines,
        gateway(engines) as gw,
        httpx.AsyncClient(base_url=gw.url) as http,
    ):
        r = await http.get("/ready")
        assert r.status_code == 200 and r.json()["healthy_replicas"] == 1
        gw.app.state.lifecycle.draining = True
        r = await http.get("/ready")
        assert r.status_code == 503 and r.json()["draining"] is True
        gw.app.state.lifecycle.draining = False
        gw.state.cluster.set_healthy(next(iter(gw.state.cluster.members)), False)
        r = await http.get("/ready")
        assert r.status_code == 503 and r.json()["healthy_replicas"] == 0
        assert (await http.get("/health")).status_code == 200


async def test_model_retrieve_and_bad_method_answer_openai_errors() -> None:
    async with sim_engines(1, "instant") as engines, gateway(engines) as gw:
        async with openai.AsyncOpenAI(
            base_url=gw.url + "/v1", api_key="k", max_retries=0
        ) as client:
            served = (await client.models.list()).data[0].id
            assert (await client.models.retrieve(served)).id == served
            with pytest.raises(openai.NotFoundError) as caught:
                await client.models.retrieve("no-such-model")
            assert caught.value.body["code"] == "model_not_found"  # type: ignore[index]
        async with httpx.AsyncClient(base_url=gw.url) as http:
            r = await http.delete("/v1/chat/completions")
            assert r.status_code == 405
            assert r.json()["error"]["type"] == "invalid_request_error"


async def test_reload_adds_and_removes_replicas_and_ignores_no_ops() -> None:
    async with sim_engines(2, "instant") as engines, gateway(engines[:1]) as gw:
        state = gw.state
        same = load_settings(replicas=replica_config(engines[:1]))
        assert await reload_replicas(state, same) is False
        assert await reload_replicas(state, load_settings()) is False  # an empty list
        assert sorted(state.cluster.members) == ["e0"]
        both = load_settings(replicas=replica_config(engines))
        assert await reload_replicas(state, both) is True
        assert sorted(state.cluster.members) == ["e0", "e1"]
        only_second = load_settings(replicas=replica_config(engines[1:]))
        assert await reload_replicas(state, only_second) is True
        assert sorted(state.cluster.members) == ["e1"]
        async with openai.AsyncOpenAI(
            base_url=gw.url + "/v1", api_key="k", max_retries=0
        ) as client:
            out = await client.chat.completions.with_raw_response.create(
                model="kvgate-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            assert out.headers["x-kvgate-replica"] == "e1"
