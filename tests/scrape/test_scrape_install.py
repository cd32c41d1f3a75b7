"""How the scraper is wired into a gateway: health feed and per-replica engine kinds."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.app import build_app
from gateway.scrape import EngineKind
from gateway.scrape.install import ScrapeHealth, scrape_settings
from gateway.settings import load_settings
from gateway.testing.servers import gateway, sim_engines
from gateway.types import ReplicaId
from gateway.upstream.h1_client import H1Client


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


@pytest.mark.parametrize(("probe_every", "reconnects"), [(0.3, False), (1.8, True)])
async def test_quiet_probes_keep_the_connection_the_quiet_reads_reuse(
    probe_every: float, reconnects: bool
) -> None:
    """Engines close a connection idle for their keep-alive (5 s for vLLM and SGLang; 1.2 s
    here). Quiet probes under it keep one open, and the quiet reads, less often than the
    keep-alive, go over it: no new connection. Probes over it reconnect each time.

    The margins are wide (probes 0.9 s inside the keep-alive) because a loaded CI machine
    delays timers by tenths of a second. One connect is allowed on the quiet side: a read
    that starts while a probe is in flight opens a second connection once. Reads that did
    not reuse the kept connection would reconnect each time, twice or more here."""
    async with (
        sim_engines(1, "instant", keep_alive_s=1.2) as engines,
        gateway(
            engines,
            health={"interval_s": 0.2, "idle_interval_s": probe_every},
            scrape={"interval_s": 0.05, "idle_interval_s": 2.0, "stale_after_s": 0.5},
        ) as gw,
    ):
        state = gw.state
        scraper = state.extras["scrape"]
        assert scraper._client is state.health.client  # one pool: probes and reads
        client = state.health.client
        assert isinstance(client, H1Client)
        connects = 0
        real_connect = client._connect

        async def counting(*args: Any, **kwargs: Any) -> Any:
            nonlocal connects
            connects += 1
            return await real_connect(*args, **kwargs)

        client._connect = counting  # type: ignore[method-assign]
        await asyncio.sleep(2.5)  # quiet: probes at probe_every, reads every 2 s
        connects, reads = 0, engines[0].metrics_requests
        await asyncio.sleep(4.5)
        assert engines[0].metrics_requests - reads >= 2
        assert (connects >= 2) if reconnects else (connects <= 1), connects
