"""`build_app` with no replicas configured runs on embedded simulated engines."""

from __future__ import annotations

import openai

from gateway.app import build_app
from gateway.serving import start_server
from gateway.settings import load_settings


async def test_default_settings_serve_from_embedded_sim() -> None:
    settings = load_settings(sim={"replicas": 2, "profile": "instant"})
    app = build_app(settings)
    server = await start_server(app)
    try:
        state = app.state.gateway
        assert sorted(state.cluster.members) == ["sim-0", "sim-1"]
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="k", max_retries=0
        ) as client:
            out = await client.chat.completions.with_raw_response.create(
                model="kvgate-sim", messages=[{"role": "user", "content": "hello"}], max_tokens=3
            )
            assert out.headers["x-kvgate-replica"] in {"sim-0", "sim-1"}
            assert out.parse().choices[0].message.content
            assert [m.id for m in (await client.models.list()).data] == ["kvgate-sim"]
    finally:
        await server.stop()
    assert "sim" in state.extras


def test_build_app_creates_independent_state() -> None:
    a = build_app(load_settings(replicas=[{"url": "http://127.0.0.1:1"}]))
    b = build_app(load_settings(replicas=[{"url": "http://127.0.0.1:1"}]))
    assert a.state.gateway is not b.state.gateway
    assert a.state.gateway.metrics.registry is not b.state.gateway.metrics.registry
