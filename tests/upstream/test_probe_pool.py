"""Health probes and the proxy's connection pool (issue 19).

A probe that queues behind proxied requests for a connection times out and ejects a replica
that is only busy; and a request that waits for a pool slot says nothing about the replica.
Real engines on loopback, as in test_h1_client.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.app import build_state
from gateway.cluster import Cluster
from gateway.errors import UpstreamConnectError
from gateway.forward import open_leg
from gateway.health import Health, HealthMonitor
from gateway.settings import HealthSettings, load_settings
from gateway.types import ReplicaId, ReplicaState
from gateway.upstream import Timeouts
from gateway.upstream.base import UpstreamPoolTimeout
from gateway.upstream.h1_client import H1Client
from tests.upstream.test_h1_client import read_request

R = ReplicaId("r0")


class Engine:
    """Answers GET at once and holds every POST until `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def _on_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await read_request(reader)
                if request.startswith(b"POST"):
                    await self.release.wait()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    e = Engine()
    e.server = await asyncio.start_server(e._on_conn, "127.0.0.1", 0)
    yield e
    e.release.set()
    e.server.close()


async def test_a_probe_does_not_wait_behind_proxied_requests(engine: Engine) -> None:
    settings = load_settings(
        replicas=[{"id": R, "url": engine.url}],
        upstream={"max_connections": 1},
        health={"timeout_s": 0.5, "failure_threshold": 1},
    )
    state = build_state(settings)
    # The proxy's one connection to the engine is busy with a long generation.
    busy = asyncio.create_task(state.client.send("POST", engine.url + "/v1/completions", [], b"{}"))
    await asyncio.sleep(0.05)
    assert not busy.done()
    assert await state.health.probe(R)
    assert state.health.state(R) is Health.HEALTHY
    engine.release.set()
    resp = await busy
    assert await resp.read() == b"{}"
    await resp.aclose()
    await state.client.aclose()
    await state.health.client.aclose()


def test_a_pool_wait_is_not_held_against_the_replica() -> None:
    # Two replicas: passive evidence never ejects the last one (gateway.health).
    cluster = Cluster(
        [ReplicaState(R, "http://127.0.0.1:9"), ReplicaState(ReplicaId("r1"), "http://127.0.0.1:9")]
    )
    health = HealthMonitor(cluster, H1Client(Timeouts()), HealthSettings(failure_threshold=1))
    health.passive_failure(R, UpstreamPoolTimeout("all connections busy"))
    assert health.state(R) is Health.HEALTHY
    health.passive_failure(R, UpstreamConnectError("refused"))
    assert health.state(R) is Health.EJECTED


async def test_open_leg_does_not_eject_a_replica_for_a_pool_wait(engine: Engine) -> None:
    cluster = Cluster([ReplicaState(R, engine.url)])
    client = H1Client(Timeouts(connect_s=0.2, response_headers_s=5, read_s=5), max_connections=1)
    health = HealthMonitor(cluster, client, HealthSettings(failure_threshold=1))
    busy = asyncio.create_task(open_leg(cluster, client, health, R, "/v1/completions", [], b"{}"))
    await asyncio.sleep(0.05)
    with pytest.raises(UpstreamPoolTimeout):
        await open_leg(cluster, client, health, R, "/v1/completions", [], b"{}")
    state = health.state(R)
    engine.release.set()
    leg = await busy
    await leg.response.read()
    await leg.aclose()
    await client.aclose()
    assert state is Health.HEALTHY
