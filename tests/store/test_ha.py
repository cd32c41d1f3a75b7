"""The store on a highly available Redis: Sentinel failover under load, and a Cluster.

Real parts only: `redis-server` processes (a master, its replica and a Sentinel; three
cluster masters), simulated engines, two `kvgate serve` processes, the official client.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest
import redis

from gateway.sim.cluster import SimCluster
from gateway.store.keys import StoreKeys
from tests.store.conftest import redis_binary
from tests.store.gateways import GatewayProcess, gateway_config, stop_all
from tests.store.ha import Cluster, Sentinels
from tests.store.test_multi_gateway import Conversation, alternate, clients

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def _binary() -> str:
    binary = redis_binary()
    if binary is None:
        pytest.skip("redis-server binary not found on PATH (CI installs it)")
    return binary


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[Sentinels]:
    ha = Sentinels(_binary(), tmp_path)
    try:
        ha.start()
        yield ha
    finally:
        ha.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    ha = Cluster(_binary(), tmp_path)
    try:
        ha.start()
        yield ha
    finally:
        ha.stop()


@pytest.fixture
async def sim() -> AsyncIterator[SimCluster]:
    async with SimCluster(4, time_scale=20.0) as engines:
        yield engines


async def _until_connected(gateways: list[GatewayProcess], timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while [await g.metric("kvgate_store_degraded") for g in gateways] != [0.0] * len(gateways):
            await asyncio.sleep(0.1)


async def test_sentinel_failover_mid_load_fails_no_request_and_keeps_sessions(
    sim: SimCluster, sentinels: Sentinels, tmp_path: Path
) -> None:
    config = gateway_config(sim.urls, sentinels.url, "ha", session_ttl_s=60)
    gateways = [GatewayProcess(config, tmp_path, f"gw{i}") for i in range(2)]
    convs = [Conversation(i) for i in range(10)]
    failures: list[BaseException] = []
    cs: list[openai.AsyncOpenAI] = []
    stop = asyncio.Event()

    async def talk(i: int, conv: Conversation) -> None:
        while not stop.is_set():
            try:
                await conv.turn(cs[(i + len(conv.replicas)) % 2])
            except (openai.APIError, KeyError) as exc:  # counted: must stay zero
                failures.append(exc)
            await asyncio.sleep(0.01)

    try:
        await asyncio.gather(*(g.start() for g in gateways))
        await _until_connected(gateways)
        cs = clients(gateways)
        load = [asyncio.create_task(talk(i, c)) for i, c in enumerate(convs)]
        await asyncio.sleep(1.0)
        placed = {c.key(): c.replicas[-1] for c in convs}
        sentinels.master.kill()
        sentinels.wait_failover()
        await _until_connected(gateways)
        mark = [len(c.replicas) for c in convs]
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*load)
        assert failures == []
        for c, m in zip(convs, mark, strict=True):
            assert len(c.replicas) > m, "requests kept flowing after the failover"
            assert len(set(c.replicas)) == 1, c.replicas  # sticky throughout
        # The promoted replica holds the placements, as the gateways wrote them.
        keys = StoreKeys("ha")
        with sentinels.replica.client() as promoted:
            assert promoted.info("replication")["role"] == "master"
            held = {
                k: promoted.get(keys.session(k))  # type: ignore[arg-type]
                for k in placed
            }
        assert {k: v.decode() for k, v in held.items() if v is not None} == placed
    finally:
        stop.set()
        for client in cs:
            await client.close()
        await stop_all(gateways)


async def test_cluster_store_shares_placements_between_gateways(
    sim: SimCluster, cluster: Cluster, tmp_path: Path
) -> None:
    config = gateway_config(sim.urls, cluster.url, "hc")
    gateways = [GatewayProcess(config, tmp_path, f"gw{i}") for i in range(2)]
    convs = [Conversation(i) for i in range(12)]
    cs: list[openai.AsyncOpenAI] = []
    try:
        await asyncio.gather(*(g.start() for g in gateways))
        await _until_connected(gateways)
        cs = clients(gateways)
        await alternate(convs, cs, 4)  # each turn on the other gateway
        for conv in convs:
            assert len(set(conv.replicas)) == 1, conv.replicas
        keys = StoreKeys("hc")
        with contextlib.closing(cluster.client()) as client:
            held = {c.key(): client.get(keys.session(c.key())) for c in convs}  # type: ignore[arg-type]
            # Spread over the masters by slot, not all on one node.
            nodes = {client.get_node_from_key(keys.session(c.key())).name for c in convs}  # type: ignore[arg-type]
        assert {k: v.decode() for k, v in held.items() if v} == {
            c.key(): c.replicas[-1] for c in convs
        }
        assert len(nodes) > 1
    finally:
        for c in cs:
            await c.close()
        await stop_all(gateways)


def test_quota_keys_share_one_slot_on_a_cluster(cluster: Cluster) -> None:
    """The admission script reads a key's and its tenant's counters and in-flight sets at
    once: on a Cluster they must hash to one slot, or the script is refused (CROSSSLOT)."""
    keys = StoreKeys("q")
    names = [
        keys.quota("key:alice", "requests", 7),
        keys.quota("key:alice", "input", 8),
        keys.quota("tenant:acme", "output", 7),
        keys.inflight("key:alice"),
        keys.inflight("tenant:acme"),
    ]
    with contextlib.closing(cluster.client()) as client:
        slots = {client.keyslot(name) for name in names}
        assert len(slots) == 1
        # And the cluster runs a multi-key script on them.
        script = "for i = 1, #KEYS do redis.call('INCR', KEYS[i]) end return #KEYS"
        assert client.eval(script, 3, *names[:3]) == 3
    with (
        pytest.raises(redis.exceptions.RedisClusterException, match="same key slot"),
        contextlib.closing(cluster.client()) as client,
    ):
        client.eval("return 1", 2, "a:plain", "b:other")
