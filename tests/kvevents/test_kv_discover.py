"""Event sources asked of the engines: vLLM's `/kv_event_sources` (as recorded from its
0.33.0 publishers) and SGLang's `/server_info` `kv_events`, then subscribed to."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from gateway.kvevents.discover import EventDiscovery, from_sglang, from_vllm
from gateway.kvevents.feed import EventFeed
from gateway.kvevents.index import EventIndex, SyncState
from gateway.kvevents.intake import EventIntake
from gateway.sim.server import KVEventsOptions
from gateway.testing.servers import sim_engines
from gateway.types import ReplicaId
from tests.kvevents.engine_fixtures import VLLM, load

R = ReplicaId("e0")


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


def test_vllm_wildcard_hosts_become_the_replica_host() -> None:
    body = load(VLLM, "http.json")["kv_event_sources"]
    source, why = from_vllm(R, "http://10.0.0.5:8000", {"0": body["0"]})
    assert source is not None, why
    port = body["0"]["endpoint"].rsplit(":", 1)[1]
    assert source.endpoint == f"tcp://10.0.0.5:{port}"
    assert source.replay_endpoint is not None and source.replay_endpoint.startswith(
        "tcp://10.0.0.5:"
    )
    # Two ranks: left to the approximate index, said why.
    assert from_vllm(R, "http://10.0.0.5:8000", body) == (
        None,
        "2 data-parallel ranks publish apart",
    )


def test_sglang_descriptor_and_its_refusals() -> None:
    kv = {
        "publisher": "zmq",
        "endpoint_host": "*",
        "endpoint_port_base": 5557,
        "topic": "",
        "block_size": 16,
        "dp_size": 1,
        "replay_endpoint_port_base": 5558,
    }
    source, _ = from_sglang(R, "http://h:30000", {"kv_events": kv}, 16)
    assert source is not None
    assert (source.endpoint, source.replay_endpoint) == ("tcp://h:5557", "tcp://h:5558")
    none, why = from_sglang(R, "http://h:30000", {"kv_events": {**kv, "block_size": 1}}, 16)
    assert none is None and "--page-size 16" in why
    assert from_sglang(R, "http://h", {"kv_events": None}, 16)[0] is None


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
async def test_an_unlisted_engine_is_found_and_followed(flavor: str) -> None:
    async with sim_engines(1, flavor=flavor, kv_events=KVEventsOptions(host="127.0.0.1")) as (
        engine,
    ):
        index = EventIndex()
        feed = EventFeed(index, warmup_s=3600)
        intake = EventIntake((), feed, dynamic=True, replay_timeout_s=1.0)
        discovery = EventDiscovery(intake, {R: engine.url}, engine.profile.block_size)
        await intake.start()
        await discovery.start()
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
            blocks = index.blocks(R)
            assert blocks is not None and blocks.media
        finally:
            await discovery.stop()
            await intake.stop()
