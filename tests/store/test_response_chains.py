"""Responses API chains across two gateway processes sharing a real redis-server: every
answer is linked to its chain's root in Redis, so a turn continued through either gateway
(even one that restarted and lost its own copy of the answers' owners) goes where the
chain is. The simulated engines keep each answer on the replica that made it, as vLLM
does: a continuation sent anywhere else is the engine's 404."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Self

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


class _SlowLink:
    """A TCP relay in front of redis-server that holds every reply `delay_s`: the
    gateways' flushes then take that long to land, as on a loaded or distant Redis."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        for task in (
            asyncio.create_task(self._pump(reader, up_writer, 0.0)),
            asyncio.create_task(self._pump(up_reader, writer, self.delay_s)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delay: float) -> None:
        try:
            while data := await src.read(1 << 16):
                if delay:
                    await asyncio.sleep(delay)
                dst.write(data)
                await dst.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            dst.close()


async def test_a_continuation_sent_at_once_through_another_gateway_finds_its_answer(
    sim: SimCluster, redis_server: RedisServer, key_prefix: str, tmp_path: Path
) -> None:
    """The answer's owner is in Redis before the client has the answer's id: with every
    Redis reply 150 ms late, a turn continued the instant the previous one arrived, through
    the other gateway, still reaches the replica that stored it (it was a 404 from the
    engine when the owner was recorded after the answer went out)."""
    async with _SlowLink(redis_server.port, 0.15) as link:
        url = f"redis://127.0.0.1:{link.port}/0"
        config = gateway_config(sim.urls, url, key_prefix, op_timeout_s=1.0, connect_timeout_s=5.0)
        gateways = [GatewayProcess(config, tmp_path, f"slow{i}") for i in range(2)]
        clients: list[openai.AsyncOpenAI] = []
        try:
            await asyncio.gather(*(g.start() for g in gateways))
            clients = [
                openai.AsyncOpenAI(base_url=g.url + "/v1", api_key="k", max_retries=0, timeout=20)
                for g in gateways
            ]
            ids: list[list[str]] = [[] for _ in range(4)]
            seen: list[list[str]] = [[] for _ in range(4)]
            await asyncio.gather(*(_chain(clients, i, 4, ids[i], seen[i]) for i in range(4)))
            assert all(len(set(s)) == 1 and len(s) == 4 for s in seen), seen
        finally:
            for client in clients:
                await client.close()
            await stop_all(gateways)
