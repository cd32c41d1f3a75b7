"""LoRA requests on the prompt side: a request naming an adapter is keyed in that adapter's
namespace, so it matches the adapter's own blocks and is never credited with the base
model's. The engine side is what vLLM 0.33.0 and SGLang 0.5.23 published (recorded)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from gateway.kvevents.adapters import AdapterNames
from gateway.kvevents.index import SyncState
from gateway.kvevents.install import KVEventsFeature
from gateway.kvevents.stage import salt_namespace
from gateway.kvevents.tokenkeys import chain_keys, in_namespace, root_seed
from gateway.testing.servers import gateway, sim_engines
from gateway.types import ReplicaId
from tests.kvevents.engine_fixtures import SGLANG, VLLM, scenario
from tests.kvevents.test_kv_engine_replay import FixturePublisher, R, _indexed, until

PLAIN = chain_keys(list(range(100, 132)), 16, root_seed())
ADAPTER = "sql-adapter"


class Listing:
    served = frozenset({"base", ADAPTER})
    adapters = frozenset({ADAPTER})


def test_how_a_request_names_an_adapter() -> None:
    names = AdapterNames(Listing())
    assert names({"model": ADAPTER}) == ADAPTER  # vLLM: the adapter's served name
    assert names({"model": "base"}) is None
    assert names({"model": "base", "lora_path": ADAPTER}) == ADAPTER  # SGLang's field
    assert names({"model": "base:other"}) == "other"  # SGLang's <base>:<adapter>
    assert names({"model": "unknown:other"}) is None
    assert AdapterNames(Listing(), {"alias": ADAPTER}.get)({"model": "alias"}) == ADAPTER


@pytest.mark.parametrize(
    ("engine", "name", "blocks"), [(VLLM, "namespaced", 2), (SGLANG, "lora", 1)]
)
async def test_an_adapter_request_matches_its_adapters_blocks_only(
    engine: str, name: str, blocks: int
) -> None:
    index = await _indexed(scenario(engine, name))
    ns = salt_namespace({"model": ADAPTER}, ADAPTER)
    assert ns is not None
    assert index.matched(R, in_namespace(PLAIN, ns), {1: 1.0})[0] == blocks
    assert index.matched(R, PLAIN, {1: 1.0})[0] == 0  # the base model's prompt: nothing
    other = salt_namespace({}, "another-adapter")
    assert other is not None and index.matched(R, in_namespace(PLAIN, other), {1: 1.0})[0] == 0


async def test_adapter_and_base_requests_each_go_where_their_own_blocks_are() -> None:
    """e0's engine holds the adapter's blocks of a prompt, e1's the base model's blocks of
    the same tokens (as recorded from vLLM 0.33.0): a request naming the adapter is sent
    to e0, one for the base model to e1."""
    pubs = {
        "e0": FixturePublisher(scenario(VLLM, "namespaced")),
        "e1": FixturePublisher(scenario(VLLM, "plain_dp_rank1")),
    }
    for pub in pubs.values():
        pub.start()
        pub.publish_all()
    sources = [
        {"replica": rid, "endpoint": p.endpoint, "replay_endpoint": p.replay_endpoint}
        for rid, p in pubs.items()
    ]
    settings: dict[str, Any] = {
        "kv_events": {"enabled": True, "sources": sources, "discover": False},
        "session": {"block_tokens": 16},
    }
    try:
        async with (
            sim_engines(2, "tiny", lora_modules=(ADAPTER,)) as engines,
            gateway(engines, **settings) as gw,
            openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client,
        ):
            feature: KVEventsFeature = gw.state.extras["kv_events"]
            states = feature.feed.states
            await until(lambda: [*states().values()] == [SyncState.SYNCED] * 2)
            await gw.state.models.refresh()
            assert gw.state.models.adapters == {ADAPTER}
            prompt = list(range(100, 132)) + [7] * 16
            served = {}
            for model in (ADAPTER, "kvgate-sim"):
                raw = await client.completions.with_raw_response.create(
                    model=model, prompt=prompt, max_tokens=1
                )
                served[model] = ReplicaId(raw.headers["x-kvgate-replica"])
            assert served == {ADAPTER: "e0", "kvgate-sim": "e1"}
    finally:
        for pub in pubs.values():
            pub.stop()
