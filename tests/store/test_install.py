"""The store wired into real apps: seams, shared ejections, remote prefix placements."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import openai
import pytest

from gateway.app import build_app
from gateway.hooks import LocalPlacements
from gateway.serving import RunningServer, start_server
from gateway.settings import KvgateSettings
from gateway.sim.cluster import SimCluster
from gateway.state import GatewayState
from gateway.store import MemoryStore
from gateway.store.install import StorePlacements
from gateway.store.redis import RedisStore
from gateway.store.sticky import StickyFirst
from gateway.types import ReplicaId
from plugins.prefix_affinity import PrefixAffinity
from tests.store.conftest import RedisServer


def settings(urls: list[str], **extra: Any) -> KvgateSettings:
    return KvgateSettings(
        replicas=[{"id": f"e{i}", "url": u, "models": ["kvgate-sim"]} for i, u in enumerate(urls)],
        models={"discover": False},
        health={"interval_s": 0.1, "failure_threshold": 1, "cooldown_s": 0.5},
        **extra,
    )


def test_memory_backend_keeps_the_core_defaults() -> None:
    app = build_app(settings(["http://127.0.0.1:9"]))
    state: GatewayState = app.state.gateway
    assert isinstance(state.placements, LocalPlacements)
    assert not isinstance(state.router, StickyFirst)
    assert isinstance(state.extras["store"], MemoryStore)


def test_redis_backend_wires_the_seams(redis_server: RedisServer) -> None:
    app = build_app(
        settings(["http://127.0.0.1:9"], store={"backend": "redis", "url": redis_server.url})
    )
    state: GatewayState = app.state.gateway
    assert isinstance(state.placements, StorePlacements)
    assert isinstance(state.router, StickyFirst)
    assert isinstance(state.extras["store"], RedisStore)
    assert state.router_placed is not None


@pytest.fixture
async def two_gateways(
    redis_server: RedisServer, key_prefix: str
) -> AsyncIterator[tuple[SimCluster, list[RunningServer]]]:
    async with SimCluster(2, time_scale=20.0) as sim:
        store = {
            "backend": "redis",
            "url": redis_server.url,
            "key_prefix": key_prefix,
            "sync_interval_s": 0.02,
            "op_timeout_s": 0.5,
        }
        routing = {"policy": "prefix_affinity"}
        servers = [
            await start_server(build_app(settings(sim.urls, store=store, routing=routing)))
            for _ in range(2)
        ]
        try:
            yield sim, servers
        finally:
            for server in servers:
                await server.stop()


def gw_state(server: RunningServer) -> GatewayState:
    app: Any = server._server.config.app
    state: GatewayState = app.state.gateway
    return state


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_an_ejection_by_one_instance_holds_on_the_other(
    two_gateways: tuple[SimCluster, list[RunningServer]],
) -> None:
    _, servers = two_gateways
    a, b = (gw_state(s) for s in servers)
    victim = ReplicaId("e1")
    a.health.record_failure(victim)  # e.g. a refused connection seen by instance a only
    await eventually(lambda: not b.cluster.is_healthy(victim))
    # a's probes find it healthy again after the cooldown and readmit it everywhere.
    await eventually(lambda: a.cluster.is_healthy(victim) and b.cluster.is_healthy(victim))


async def test_prefix_placements_of_one_instance_reach_the_other_index(
    two_gateways: tuple[SimCluster, list[RunningServer]],
) -> None:
    _, servers = two_gateways
    b = gw_state(servers[1])
    router = b.router
    assert isinstance(router, StickyFirst)
    scorer = router.scorer
    assert isinstance(scorer, PrefixAffinity)
    assert scorer.index.total_blocks == 0
    messages = [{"role": "user", "content": "a long shared document " * 200}]
    async with openai.AsyncOpenAI(
        base_url=servers[0].url + "/v1", api_key="k", max_retries=0
    ) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="kvgate-sim",
            messages=messages,
            max_tokens=2,  # type: ignore[arg-type]
        )
    served = ReplicaId(raw.headers["x-kvgate-replica"])
    # b never saw the request, yet its prefix index learns where the prefix lives.
    await eventually(lambda: scorer.index.size(served) > 0)
    assert scorer.index.total_blocks == scorer.index.size(served)
