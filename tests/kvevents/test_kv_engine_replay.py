"""The recorded engine frames (vLLM 0.33.0, SGLang 0.5.23) through the real intake: a
publisher on loopback sends the fixtures' bytes as the engine's PUB and replay ROUTER did,
and a gateway joins after the engine has published, then loses and regains its
connection. Done when: 0 malformed batches, and no resync wipes the index."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest
import zmq
from prometheus_client import CollectorRegistry

from gateway.kvevents.feed import EventFeed
from gateway.kvevents.index import EventIndex, SyncState
from gateway.kvevents.intake import EventIntake, Source
from gateway.kvevents.metrics import KVEventMetrics
from gateway.kvevents.tokenkeys import chain_keys, root_seed
from gateway.types import ReplicaId
from tests.kvevents.engine_fixtures import SGLANG, VLLM, Scenario, all_scenarios, scenario

R = ReplicaId("e0")


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


class FixturePublisher:
    """Sends a scenario's recorded frames unchanged: its live messages on a PUB, and its
    recorded replay answers (4 frames each, then the end marker) on a ROUTER."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        rport = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self.replays = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _serve(self) -> None:
        *batches, end = self.sc.replay_from_0
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            client, _, start = self.router.recv_multipart()
            self.replays += 1
            first = int.from_bytes(start, "big")
            for frames in batches:
                if int.from_bytes(frames[2], "big") >= first:
                    self.router.send_multipart([client, *frames])
            self.router.send_multipart([client, *end])

    def publish_all(self) -> None:
        for frames in self.sc.live:
            self.pub.send_multipart(frames)

    def rebind_pub(self) -> None:
        """The connection drops and comes back (same engine, same numbering)."""
        self.pub.close(0)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        for _ in range(250):  # the closed socket lets go of its port in the background
            try:
                self.pub.bind(self.endpoint)
                return
            except zmq.ZMQError:
                time.sleep(0.02)
        raise AssertionError("port not released")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


class Gateway:
    def __init__(self, sc: Scenario, pub: FixturePublisher, block_size: int | None = None) -> None:
        self.registry = CollectorRegistry()
        self.index = EventIndex()
        self.feed = EventFeed(self.index, KVEventMetrics(self.registry), warmup_s=3600)
        source = Source(R, pub.endpoint, pub.replay_endpoint, sc.topic)
        self.intake = EventIntake((source,), self.feed, replay_timeout_s=1.0, block_size=block_size)

    def value(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, {"replica": "e0", **labels}) or 0.0

    def resyncs(self) -> dict[str, float]:
        out = {}
        for metric in self.registry.collect():
            if metric.name == "kvgate_kv_events_resyncs":
                for s in metric.samples:
                    if s.name.endswith("_total") and s.value:
                        out[s.labels["reason"]] = s.value
        return out


@pytest.mark.parametrize("block_size", [None, 16], ids=["as-sent", "recut-16"])
@pytest.mark.parametrize("sc", all_scenarios(), ids=lambda s: f"{s.engine}:{s.name}")
async def test_fixtures_replay_with_no_rejected_batch_and_no_wipe(
    sc: Scenario, block_size: int | None
) -> None:
    pub = FixturePublisher(sc)
    pub.start()
    pub.publish_all()  # the engine published before the gateway came up
    gw = Gateway(sc, pub, block_size)
    await gw.intake.start()
    try:
        # Joining: the whole history comes from the replay endpoint.
        await until(lambda: gw.resyncs().get("join_replayed") == 1)
        assert gw.feed.state(R) is SyncState.SYNCED
        batches = gw.value("kvgate_kv_events_batches_total")
        assert batches == len(sc.live)
        # The connection drops and comes back: what was missed is asked for again.
        replays = pub.replays
        pub.rebind_pub()
        await until(lambda: pub.replays > replays)
        await until(lambda: "reconnect_replayed" in gw.resyncs())
        assert gw.value("kvgate_kv_events_malformed_total") == 0
        assert not [r for r in gw.resyncs() if r.endswith("_cleared")]
        assert gw.feed.state(R) is SyncState.SYNCED
    finally:
        await gw.intake.stop()
        pub.stop()


async def _indexed(sc: Scenario, block_size: int | None = None) -> EventIndex:
    pub = FixturePublisher(sc)
    pub.start()
    pub.publish_all()
    gw = Gateway(sc, pub, block_size)
    await gw.intake.start()
    try:
        await until(lambda: gw.resyncs().get("join_replayed") == 1)
        return gw.index
    finally:
        await gw.intake.stop()
        pub.stop()


TOKENS = list(range(100, 148))


def _plain(block_size: int) -> list[int]:
    return chain_keys(TOKENS, block_size, root_seed())


async def test_sglang_eagle_pairs_are_keyed_as_their_tokens() -> None:
    index = await _indexed(scenario(SGLANG, "eagle_bigram_page1"))
    # 32 bigram pages: the pages hold tokens 100..131.
    assert index.matched(R, _plain(1), {1: 1.0})[0] == 32


@pytest.mark.parametrize(
    ("engine", "name"),
    [(SGLANG, "salted"), (SGLANG, "lora"), (VLLM, "namespaced")],
)
async def test_salted_and_adapter_blocks_never_match_a_plain_prompt(engine: str, name: str) -> None:
    index = await _indexed(scenario(engine, name))
    blocks = index.blocks(R)
    assert blocks is not None and blocks.media  # indexed...
    assert index.matched(R, _plain(16), {1: 1.0})[0] == 0  # ...but not as plain blocks


async def test_offload_tiers_count_at_their_weight() -> None:
    from gateway.kvevents.config import KVEventsSettings
    from gateway.kvevents.evidence import weights_by_bit

    weights = weights_by_bit(KVEventsSettings().medium_weights)
    index = await _indexed(scenario(VLLM, "tiers"))
    # GPU copy removed last: the block stays on CPU and STORAGE, worth the better one.
    assert index.matched(R, _plain(16)[:1], weights) == (1, 0.5)
    assert weights[16] == 0.25  # STORAGE / EXTERNAL


async def test_hybrid_models_index_the_full_attention_group() -> None:
    index = await _indexed(scenario(VLLM, "hybrid"))
    blocks = index.blocks(R)
    assert blocks is not None and blocks.group == 1
    # The sliding-window group's removal does not take the full-attention block away.
    assert index.matched(R, _plain(16)[:1], {1: 1.0})[0] == 1


async def test_a_salted_prompt_matches_the_blocks_of_its_own_salt_only() -> None:
    from gateway.kvevents.stage import salt_namespace
    from gateway.kvevents.tokenkeys import in_namespace

    index = await _indexed(scenario(SGLANG, "salted"))
    own = salt_namespace({"cache_salt": "tenant-a"})
    other = salt_namespace({"cache_salt": "tenant-b"})
    assert own is not None and other is not None
    assert index.matched(R, in_namespace(_plain(16)[:1], own), {1: 1.0})[0] == 1
    assert index.matched(R, in_namespace(_plain(16)[:1], other), {1: 1.0})[0] == 0
    assert salt_namespace({"prompt": "x"}) is None


@pytest.mark.parametrize(("name", "blocks"), [("page1", 3), ("eagle_bigram_page1", 2)])
async def test_sglang_page_size_1_is_recut_to_kvgates_block_size(name: str, blocks: int) -> None:
    """SGLang's default page size 1 (and EAGLE's pairs at it), as its own publisher sent
    them, with kvgate keying at 16: prompts keyed at 16 match the engine's pages."""
    index = await _indexed(scenario(SGLANG, name), block_size=16)
    held = index.blocks(R)
    assert held is not None and held.block_size == 16
    assert index.matched(R, _plain(16), {1: 1.0})[0] == blocks
    # Passed on as they came, the pages are keyed at 1 and no prompt at 16 matches them.
    plain = await _indexed(scenario(SGLANG, name))
    assert plain.matched(R, _plain(16), {1: 1.0})[0] == 0
