"""`build_app` with no replicas configured runs on embedded simulated engines."""

from __future__ import annotations

import asyncio
import logging

import openai
import pytest
from starlette.applications import Starlette

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


# -- the lifespan releases what it started, on every way out -------------------------------


class _Service:
    def __init__(
        self, name: str, events: list[str], *, start_fails: bool = False, stop_fails: bool = False
    ) -> None:
        self.name, self.events = name, events
        self.start_fails, self.stop_fails = start_fails, stop_fails

    async def start(self) -> None:
        self.events.append(f"start {self.name}")
        if self.start_fails:
            raise RuntimeError(f"{self.name} cannot start")

    async def stop(self) -> None:
        self.events.append(f"stop {self.name}")
        if self.stop_fails:
            raise RuntimeError(f"{self.name} cannot stop")


def _quiet_app() -> Starlette:
    # A replica that is never asked: no discovery, no probes reaching anything.
    return build_app(
        load_settings(
            replicas=[{"id": "x", "url": "http://127.0.0.1:9"}],
            models={"discover": False},
            health={"enabled": False},
        )
    )


def _lifespan_tasks() -> set[str]:
    return {t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("kvgate-")}


async def test_a_service_that_fails_to_start_stops_those_started_before_it() -> None:
    events: list[str] = []
    app = _quiet_app()
    state = app.state.gateway
    state.services.extend(
        [
            _Service("a", events),
            _Service("b", events, start_fails=True),
            _Service("c", events),
        ]
    )
    with pytest.raises(RuntimeError):
        await start_server(app)
    assert events == ["start a", "start b", "stop a"]  # c never started, b never stopped
    assert not _lifespan_tasks()  # the health task was cancelled, not left running


async def test_a_service_that_fails_to_stop_does_not_keep_the_others_running(
    caplog: pytest.LogCaptureFixture,
) -> None:
    events: list[str] = []
    app = _quiet_app()
    app.state.gateway.services.extend(
        [_Service("a", events), _Service("b", events, stop_fails=True), _Service("c", events)]
    )
    server = await start_server(app)
    assert _lifespan_tasks()
    with caplog.at_level(logging.ERROR, logger="kvgate"):
        await server.stop()
    assert events == ["start a", "start b", "start c", "stop c", "stop b", "stop a"]
    assert "stopping" in caplog.text and "failed" in caplog.text
    assert not _lifespan_tasks()
