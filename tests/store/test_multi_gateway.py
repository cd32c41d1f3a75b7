"""Two gateway processes sharing Redis, behind a client that alternates between them.

Real parts only: simulated engines (gateway.sim) served in this process, two `kvgate
serve` processes, a real redis-server, the official openai client.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
import redis

from gateway.keys import session_key
from gateway.ring import DEFAULT_VNODES, HashRing, RingNode
from gateway.sim.cluster import SimCluster
from gateway.sim.faults import FaultConfig
from gateway.types import Endpoint, ReplicaId
from tests.store.conftest import RedisServer
from tests.store.gateways import GatewayProcess, gateway_config, stop_all

pytestmark = [pytest.mark.redis, pytest.mark.slow]

MODEL = "kvgate-sim"


class Conversation:
    def __init__(self, index: int) -> None:
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": "You are a terse assistant. " * 8},
            {
                "role": "user",
                "content": f"conversation {index}: tell me about topic {index * 7919}",
            },
        ]
        self.replicas: list[str] = []

    async def turn(self, client: openai.AsyncOpenAI) -> str:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=self.messages,
            max_tokens=4,  # type: ignore[arg-type]
        )
        replica = raw.headers["x-kvgate-replica"]
        answer = raw.parse().choices[0].message.content or ""
        self.messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"and then? ({len(self.messages)})"},
        ]
        self.replicas.append(replica)
        return replica

    def key(self) -> str:
        return session_key({"model": MODEL, "messages": self.messages}, Endpoint.CHAT, None)[0]


@pytest.fixture
async def sim() -> AsyncIterator[SimCluster]:
    async with SimCluster(4, time_scale=20.0) as cluster:
        yield cluster


def clients(gateways: list[GatewayProcess]) -> list[openai.AsyncOpenAI]:
    return [
        openai.AsyncOpenAI(base_url=g.url + "/v1", api_key="k", max_retries=0, timeout=20)
        for g in gateways
    ]


async def alternate(convs: list[Conversation], cs: list[openai.AsyncOpenAI], turns: int) -> None:
    """Each conversation's successive turns go to alternating gateways."""
    for _ in range(turns):
        await asyncio.gather(
            *(c.turn(cs[(i + len(c.replicas)) % len(cs)]) for i, c in enumerate(convs))
        )


def ring_owner(key: str, ids: list[str]) -> str:
    ring = HashRing((RingNode(ReplicaId(i)) for i in ids), DEFAULT_VNODES)
    return ring.walk(key)[0]


async def test_conversations_stay_put_across_gateways_adds_and_failures(
    sim: SimCluster, redis_server: RedisServer, key_prefix: str, tmp_path: Path
) -> None:
    urls = sim.urls
    three = gateway_config(urls[:3], redis_server.url, key_prefix)
    gateways = [GatewayProcess(three, tmp_path, f"gw{i}") for i in range(2)]
    convs = [Conversation(i) for i in range(16)]
    cs: list[openai.AsyncOpenAI] = []
    try:
        await asyncio.gather(*(g.start() for g in gateways))
        cs = clients(gateways)
        await alternate(convs, cs, 3)
        for c in convs:
            assert len(set(c.replicas)) == 1, c.replicas
        placed = {id(c): c.replicas[-1] for c in convs}

        # Add a replica: the gateways restart with four (their local state is gone).
        # The ring alone would move some conversations to e3; the shared store must not.
        moved_by_ring = [c for c in convs if ring_owner(c.key(), ["e0", "e1", "e2", "e3"]) == "e3"]
        assert moved_by_ring, "test setup: the new replica owns none of the conversations"
        await stop_all(gateways)
        four = gateway_config(urls, redis_server.url, key_prefix)
        gateways = [GatewayProcess(four, tmp_path, f"gw{i}-four") for i in range(2)]
        await asyncio.gather(*(g.start() for g in gateways))
        for client in cs:
            await client.close()
        cs = clients(gateways)
        await alternate(convs, cs, 2)
        for c in convs:
            assert set(c.replicas) == {placed[id(c)]}, c.replicas
        fresh = [Conversation(100 + i) for i in range(16)]
        await alternate(fresh, cs, 2)
        assert "e3" in {c.replicas[0] for c in fresh}, "the added replica takes new sessions"
        for c in fresh:
            assert len(set(c.replicas)) == 1, c.replicas

        # One replica fails: its conversations move once, both gateways agree on the new
        # home, and they stay there after it recovers.
        everyone = convs + fresh
        count: dict[str, int] = defaultdict(int)
        for c in everyone:
            count[c.replicas[-1]] += 1
        victim = max(count, key=lambda r: count[r])
        index = int(victim[1:])
        before = {id(c): c.replicas[-1] for c in everyone}
        await sim.engines[index].set_faults(FaultConfig(refuse=True))
        await alternate(everyone, cs, 3)
        await sim.engines[index].set_faults(FaultConfig())
        await asyncio.sleep(1.5)  # cooldown + probes: the victim is healthy again
        await alternate(everyone, cs, 2)
        for c in everyone:
            after = c.replicas[-5:]
            if before[id(c)] == victim:
                assert victim not in after and len(set(after)) == 1, after
            else:
                assert set(after) == {before[id(c)]}, after
    finally:
        for client in cs:
            await client.close()
        await stop_all(gateways)


async def test_redis_restart_mid_load_no_failures_and_stickiness_restored(
    sim: SimCluster, own_redis: RedisServer, key_prefix: str, tmp_path: Path
) -> None:
    config = gateway_config(sim.urls, own_redis.url, key_prefix, session_ttl_s=30)
    gateways = [GatewayProcess(config, tmp_path, f"gw{i}") for i in range(2)]
    convs = [Conversation(i) for i in range(12)]
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
        cs = clients(gateways)
        load = [asyncio.create_task(talk(i, c)) for i, c in enumerate(convs)]
        await asyncio.sleep(1.0)
        own_redis.kill()
        await asyncio.sleep(0.5)
        assert [await g.metric("kvgate_store_degraded") for g in gateways] == [1.0, 1.0]
        during = sum(len(c.replicas) for c in convs)
        await asyncio.sleep(1.0)
        assert sum(len(c.replicas) for c in convs) > during, "requests kept flowing"
        own_redis.start()
        for _ in range(100):
            if [await g.metric("kvgate_store_degraded") for g in gateways] == [0.0, 0.0]:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("gateways did not reconnect to redis")
        mark = [len(c.replicas) for c in convs]
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*load)
        assert failures == []
        for c, m in zip(convs, mark):
            assert len(c.replicas) > m
            assert len(set(c.replicas[m:])) == 1, c.replicas
        # The restarted Redis holds the placements again, and only a bounded set of keys.
        client = own_redis.client()
        try:
            sessions = list(client.scan_iter(match=f"{key_prefix}:sess:*"))
            everything = list(client.scan_iter(match=f"{key_prefix}:*"))
            assert len(sessions) == len(convs)
            held = {client.get(k).decode() for k in sessions}  # type: ignore[union-attr]
            assert held == {c.replicas[-1] for c in convs}
            # Besides: shared scraping's member set, its loads, one lease per engine and,
            # while it has asks to pop, a wake set per gateway (gateway.scrape).
            scraping = [k for k in everything if b":{scrape}:" in k]
            assert len(everything) - len(scraping) <= len(convs) + 4
            assert len(scraping) <= 2 + len(sim.urls) + len(gateways)
        finally:
            client.close()
        assert "store degraded" in gateways[0].log() and "resynchronised" in gateways[0].log()
    finally:
        stop.set()
        for client in cs:
            await client.close()
        await stop_all(gateways)


async def test_workers_share_placements_through_redis(
    sim: SimCluster, redis_server: RedisServer, key_prefix: str, tmp_path: Path
) -> None:
    config = gateway_config(sim.urls, redis_server.url, key_prefix)
    gateway = GatewayProcess(config, tmp_path, "workers", workers=2)
    convs = [Conversation(i) for i in range(8)]
    try:
        await gateway.start()
        for _ in range(4):
            # A fresh client per turn: a new connection, so the kernel may pick either worker.
            async with openai.AsyncOpenAI(
                base_url=gateway.url + "/v1", api_key="k", max_retries=0, timeout=20
            ) as client:
                await asyncio.gather(*(c.turn(client) for c in convs))
        for c in convs:
            assert len(set(c.replicas)) == 1, c.replicas
        client = redis.Redis(port=redis_server.port)
        try:
            assert len(list(client.scan_iter(match=f"{key_prefix}:sess:*"))) == len(convs)
            # Each worker's store connects from its own lifespan; on a loaded machine the
            # second one may still be starting, so give it time instead of racing it.
            names: set[str] = set()
            for _ in range(100):
                names = {c["name"] for c in client.client_list() if c["name"].startswith("kvgate-")}
                if len(names) >= 2:
                    break
                await asyncio.sleep(0.1)
            assert len(names) >= 2, "each worker runs its own store instance"
        finally:
            client.close()
    finally:
        await gateway.stop()
