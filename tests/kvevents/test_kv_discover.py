"""Event sources asked of the engines: vLLM's `/kv_event_sources` (as recorded from its
0.33.0 publishers) and SGLang's `/server_info` `kv_events`, then subscribed to."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from gateway.facts.service import EngineFactsService
from gateway.kvevents.discover import EventDiscovery, from_sglang, from_vllm
from gateway.kvevents.feed import EventFeed
from gateway.kvevents.index import EventIndex, SyncState
from gateway.kvevents.install import KVEventsFeature
from gateway.kvevents.intake import EventIntake, replica_of, stream_id
from gateway.sim.faults import FaultConfig
from gateway.sim.server import KVEventsOptions
from gateway.testing.servers import gateway, sim_engines
from gateway.types import ReplicaId
from tests.kvevents.engine_fixtures import VLLM, load

R = ReplicaId("e0")


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


def test_vllm_wildcard_hosts_become_the_replica_host_and_every_rank_is_followed() -> None:
    body = load(VLLM, "http.json")["kv_event_sources"]
    sources, why = from_vllm(R, "http://10.0.0.5:8000", body)
    assert len(sources) == 2, why
    for rank, source in enumerate(sources):
        port = body[str(rank)]["endpoint"].rsplit(":", 1)[1]
        assert source.rank == rank
        assert source.endpoint == f"tcp://10.0.0.5:{port}"
        assert source.replay_endpoint is not None
        assert source.replay_endpoint.startswith("tcp://10.0.0.5:")
    # Rank 0 is the replica's own stream, rank 1 a stream of its own under it.
    assert sources[0].stream == R and sources[1].stream == stream_id(R, 1)
    assert replica_of(sources[1].stream) == R
    assert from_vllm(R, "http://h", {}) == (
        (),
        "no KV event publisher (start vLLM with --kv-events-config)",
    )


def test_sglang_descriptor_per_rank_at_any_page_size() -> None:
    kv = {
        "publisher": "zmq",
        "endpoint_host": "*",
        "endpoint_port_base": 5557,
        "topic": "",
        "block_size": 1,
        "dp_size": 2,
        "replay_endpoint_port_base": 5600,
    }
    sources, _ = from_sglang(R, "http://h:30000", kv)
    assert [(s.endpoint, s.replay_endpoint, s.rank) for s in sources] == [
        ("tcp://h:5557", "tcp://h:5600", 0),
        ("tcp://h:5558", "tcp://h:5601", 1),
    ]
    assert from_sglang(R, "http://h", None)[0] == ()


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
async def test_an_unlisted_engine_is_found_and_followed(flavor: str) -> None:
    async with sim_engines(1, flavor=flavor, kv_events=KVEventsOptions(host="127.0.0.1")) as (
        engine,
    ):
        index = EventIndex()
        feed = EventFeed(index, warmup_s=3600)
        intake = EventIntake((), feed, dynamic=True, replay_timeout_s=1.0)
        facts = EngineFactsService(lambda: {R: engine.url})
        discovery = EventDiscovery(intake, [R])
        facts.listeners.append(discovery)
        await intake.start()
        await facts.start()
        try:
            await until(lambda: R in discovery.found)
            # The engine caches a prompt and publishes it: the subscription sees it.
            async with httpx.AsyncClient() as client:
                r = await client.post(
                    engine.url + "/v1/completions",
                    json={"model": engine.model_name, "prompt": "x" * 1024, "max_tokens": 1},
                )
                assert r.status_code == 200
            await until(lambda: feed.state(R) is SyncState.SYNCED)
            # Synced may come first (a replay or an earlier batch) and the prompt's blocks in
            # a later batch: on a busy host (the suite under -n 3) they had not yet arrived.
            await until(lambda: bool((blocks := index.blocks(R)) is not None and blocks.media))
        finally:
            await facts.stop()
            await intake.stop()


async def test_a_replica_back_in_service_is_followed_where_it_publishes_now() -> None:
    """The engine goes out of service and comes back with its publisher on other ports (a
    restart): the gateway reads its description again and follows the new streams."""
    health = {"interval_s": 0.1, "timeout_s": 0.5, "cooldown_s": 0.2, "success_threshold": 1}
    async with (
        sim_engines(1, "tiny", kv_events=KVEventsOptions()) as (engine,),
        gateway([engine], health=health, kv_events={"enabled": True}) as gw,
    ):
        feature: KVEventsFeature = gw.state.extras["kv_events"]
        facts: EngineFactsService = gw.state.extras["facts"]
        discovery = next(x for x in facts.listeners if isinstance(x, EventDiscovery))
        await until(lambda: R in discovery.found)
        before = discovery.found[R]
        await engine.set_faults(FaultConfig(unhealthy=True))
        await until(lambda: not gw.state.cluster.view().replicas[0].healthy)
        engine.stop_kv_events()
        engine.kv_publisher = None  # started again on ports of its own choosing
        engine.start_kv_events()
        await engine.set_faults(FaultConfig())
        await until(lambda: discovery.found.get(R, before) != before)
        assert discovery.found[R][0].endpoint == engine.kv_publisher.endpoint
        async with httpx.AsyncClient() as client:
            r = await client.post(
                engine.url + "/v1/completions",
                json={"model": engine.model_name, "prompt": "y" * 1024, "max_tokens": 1},
            )
            assert r.status_code == 200

        def indexed() -> bool:
            blocks = feature.index.blocks(R)
            return feature.feed.state(R) is SyncState.SYNCED and bool(blocks and blocks.media)

        await until(indexed)
