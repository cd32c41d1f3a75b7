"""How the scraper is wired into a gateway: health feed and per-replica engine kinds."""

from __future__ import annotations

from gateway.app import build_app
from gateway.scrape import EngineKind
from gateway.scrape.install import ScrapeHealth, scrape_settings
from gateway.settings import load_settings
from gateway.types import ReplicaId


async def test_unreachable_metrics_eject_but_unreadable_ones_do_not() -> None:
    app = build_app(
        load_settings(
            replicas=[
                {"id": "a", "url": "http://127.0.0.1:9"},
                {"id": "b", "url": "http://127.0.0.1:9"},
            ],
            health={"failure_threshold": 2},
        )
    )
    state = app.state.gateway
    sink = ScrapeHealth(state.health)
    a, b = ReplicaId("a"), ReplicaId("b")
    for _ in range(3):
        sink.scrape_failed(b, "parse")
        sink.scrape_failed(b, "timeout")
        sink.scrape_failed(b, "status_404")
    assert state.cluster.is_healthy(b)
    sink.scrape_failed(a, "connect")
    assert state.cluster.is_healthy(a)
    sink.scrape_failed(a, "connect")
    assert not state.cluster.is_healthy(a)
    sink.scrape_succeeded(b)  # a healthy replica's success is a no-op
    assert state.cluster.is_healthy(b)
    await state.client.aclose()


async def test_engine_kinds_come_from_replicas_and_scrape_overrides() -> None:
    app = build_app(
        load_settings(
            replicas=[
                {"id": "v", "url": "http://127.0.0.1:9", "engine": "vllm"},
                {"id": "s", "url": "http://127.0.0.1:9", "engine": "sglang"},
                {"id": "x", "url": "http://127.0.0.1:9"},
            ],
            scrape={"engines": {"s": "tgi"}},
        )
    )
    settings = scrape_settings(app.state.gateway)
    assert settings.engine_for("v") is EngineKind.VLLM
    assert settings.engine_for("s") is EngineKind.TGI
    assert settings.engine_for("x") is EngineKind.AUTO
    await app.state.gateway.client.aclose()
