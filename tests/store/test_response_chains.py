"""Responses API chains across two gateway processes sharing a real redis-server: every
answer is linked to its chain's root in Redis, so a turn continued through either gateway
(even one that restarted and lost its own copy of the answers' owners) goes where the
chain is. The simulated engines keep each answer on the replica that made it, as vLLM
does: a continuation sent anywhere else is the engine's 404."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from gateway.hashing import digest_hex
from gateway.sim.cluster import SimCluster
from tests.store.conftest import RedisServer
from tests.store.gateways import GatewayProcess, gateway_config, stop_all

pytestmark = [pytest.mark.redis, pytest.mark.slow]

MODEL = "kvgate-sim"
CHAINS = 8


@pytest.fixture
async def sim() -> AsyncIterator[SimCluster]:
    async with SimCluster(4, time_scale=20.0) as cluster:
        yield cluster


async def _turn(
    client: openai.AsyncOpenAI, text: str, previous: str | None, stream: bool
) -> tuple[str, str]:
    extra = {"previous_response_id": previous} if previous else {}
    raw = await client.responses.with_raw_response.create(
        model=MODEL, input=text, max_output_tokens=2, stream=stream, **extra
    )  # type: ignore[call-overload]
    replica: str = raw.headers["x-kvgate-replica"]
    if not stream:
        return raw.parse().id, replica
    ids = [e.response.id async for e in raw.parse() if e.type == "response.created"]
    return ids[0], replica


async def _chain(
    clients: list[openai.AsyncOpenAI], index: int, turns: int, ids: list[str], seen: list[str]
) -> None:
    """Continue chain `index` by `turns` turns, alternating gateways."""
    for _ in range(turns):
        n = len(ids)
        client = clients[(index + n) % len(clients)]
        text = f"chain {index} opens on topic {index * 7919}" if n == 0 else f"turn {n}"
        answer, replica = await _turn(client, text, ids[-1] if ids else None, n % 2 == 1)
        ids.append(answer)
        seen.append(replica)


async def test_chains_follow_their_root_across_gateways_and_restarts(
    sim: SimCluster, redis_server: RedisServer, key_prefix: str, tmp_path: Path
) -> None:
    config = gateway_config(sim.urls, redis_server.url, key_prefix)
    gateways = [GatewayProcess(config, tmp_path, f"gw{i}") for i in range(2)]
    clients: list[openai.AsyncOpenAI] = []
    ids: list[list[str]] = [[] for _ in range(CHAINS)]
    seen: list[list[str]] = [[] for _ in range(CHAINS)]
    try:
        await asyncio.gather(*(g.start() for g in gateways))
        clients = [
            openai.AsyncOpenAI(base_url=g.url + "/v1", api_key="k", max_retries=0, timeout=20)
            for g in gateways
        ]
        await asyncio.gather(*(_chain(clients, i, 4, ids[i], seen[i]) for i in range(CHAINS)))
        assert all(len(set(s)) == 1 for s in seen), seen
        assert len({s[0] for s in seen}) >= 2, seen  # the chains themselves spread

        # Every answer after the first is linked to the chain's root, in Redis.
        r = redis_server.client()
        await asyncio.sleep(0.3)  # one flush
        for chain in ids:
            root = digest_hex(chain[0])
            for answer in chain[1:]:
                held = r.get(f"{key_prefix}:chain:{digest_hex(answer)}")
                assert held is not None and held.decode() == root, (chain, answer)
            assert r.get(f"{key_prefix}:sess:rc:{root}") is not None

        # Both gateways restart (their local copies are gone) and the answers' own owner
        # records are lost too: the links to the roots still find each chain's replica.
        for client in clients:
            await client.close()
        await stop_all(gateways)
        owners = list(r.scan_iter(f"{key_prefix}:sess:r:*"))
        assert len(owners) >= CHAINS * 4
        r.delete(*owners)
        gateways = [GatewayProcess(config, tmp_path, f"gw{i}-again") for i in range(2)]
        await asyncio.gather(*(g.start() for g in gateways))
        clients = [
            openai.AsyncOpenAI(base_url=g.url + "/v1", api_key="k", max_retries=0, timeout=20)
            for g in gateways
        ]
        await asyncio.gather(*(_chain(clients, i, 2, ids[i], seen[i]) for i in range(CHAINS)))
        assert all(len(set(s)) == 1 and len(s) == 6 for s in seen), seen
    finally:
        for client in clients:
            await client.close()
        await stop_all(gateways)
