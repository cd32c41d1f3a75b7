"""The simulated engine's KV event publishing (gateway.sim.kvpublish, SimEngine's
start/stop_kv_events): a real engine on loopback driven over HTTP, its ZMQ stream read by a
SUB socket and a replay DEALER and decoded by the gateway's own decoder; the stream mirrors
the cache, a restart numbers from 0 after AllBlocksCleared, replays answer both formats."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
import zmq
from sim_helpers import chat_body, test_profile

from gateway.kvevents.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    decode_seq,
)
from gateway.sim.cluster import SimCluster
from gateway.sim.kvpublish import KVEventPublisher
from gateway.sim.server import KVEventsOptions, SimEngine
from gateway.sim.tokenizer import approx_token_ids, render_chat

Frames = list[bytes]


class Sockets:
    """A SUB on the live stream and a DEALER on the replay socket (blocking: the publisher
    sends from its own thread, so a test may wait on them)."""

    def __init__(self, publisher: KVEventPublisher) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(publisher.endpoint)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.connect(publisher.replay_endpoint or "")

    def live(self, until: int, timeout_ms: int = 3000) -> list[Frames]:
        """Live messages up to and including sequence number `until`."""
        out: list[Frames] = []
        while self.sub.poll(timeout_ms):
            frames = self.sub.recv_multipart()
            out.append(frames)
            if decode_seq(frames[1]) >= until:
                break
        return out

    def replay(self, start: int) -> list[Frames]:
        self.dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        out: list[Frames] = []
        while self.dealer.poll(3000):
            frames = self.dealer.recv_multipart()
            out.append(frames)
            if decode_seq(frames[-2]) == -1:
                break
        return out

    def close(self) -> None:
        self.sub.close(0)
        self.dealer.close(0)
        self.ctx.term()


async def drained(publisher: KVEventPublisher) -> int:
    """What the publisher sent once its thread emptied the queue (it sends on its own)."""
    seen = -1
    for _ in range(300):
        if publisher._queue.empty() and publisher.published == seen:
            return seen
        seen = publisher.published
        await asyncio.sleep(0.01)
    raise AssertionError("the publisher never caught up")


def events(messages: list[Frames]) -> Iterator[object]:
    for frames in messages:
        yield from decode_batch(frames[-1]).events


async def test_the_stream_mirrors_the_cache_and_replays_it() -> None:
    async with (
        SimCluster(1, test_profile(num_gpu_blocks=24), kv_events=KVEventsOptions()) as cluster,
        httpx.AsyncClient(base_url=cluster.urls[0], timeout=10) as http,
    ):
        engine: SimEngine = cluster.engines[0]
        publisher = engine.kv_publisher
        assert publisher is not None
        sockets = Sockets(publisher)
        try:
            await asyncio.sleep(0.2)  # a SUB joins late: let it connect first
            prompts = [f"conversation {i} " * 30 for i in range(4)]  # 4 x ~8 blocks > 24
            for text in prompts:
                reply = await http.post("/v1/chat/completions", json=chat_body(text, max_tokens=2))
                assert reply.status_code == 200
            last = await drained(publisher) - 1
            live = sockets.live(last)
            replayed = sockets.replay(0)
        finally:
            sockets.close()
        cached = set(engine.model.kv._cached)
    assert [decode_seq(f[1]) for f in live] == list(range(last + 1))
    assert all(f[0] == b"kv-events" for f in live)
    seen: set[int] = set()
    removed = 0
    first_stored: BlockStored | None = None
    for event in events(live):
        if isinstance(event, BlockStored):
            first_stored = first_stored or event
            seen.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            removed += len(event.block_hashes)
            seen.difference_update(event.block_hashes)
    assert seen == cached and removed == engine.model.kv.evictions > 0
    # The stored tokens are the prompt's own ids, block by block.
    assert first_stored is not None and first_stored.block_size == 16
    text = render_chat([{"role": "user", "content": prompts[0]}])
    ids = tuple(approx_token_ids(text))
    assert first_stored.token_ids == ids[: len(first_stored.token_ids)]
    assert first_stored.parent_block_hash is None
    # The replay is every buffered message after [empty, topic], then the end marker.
    assert replayed[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    assert [f[1:] for f in replayed[:-1]] == live


async def test_a_restarted_publisher_clears_first_and_numbers_from_zero() -> None:
    async with (
        SimCluster(1, test_profile(), kv_events=KVEventsOptions()) as cluster,
        httpx.AsyncClient(base_url=cluster.urls[0], timeout=10) as http,
    ):
        engine = cluster.engines[0]
        old = engine.kv_publisher
        assert old is not None
        await http.post("/v1/chat/completions", json=chat_body("warm " * 80, max_tokens=1))
        assert await drained(old) > 0 and engine.model.kv.num_cached_blocks > 0
        engine.stop_kv_events()
        await http.post("/v1/chat/completions", json=chat_body("lost " * 80, max_tokens=1))
        engine.start_kv_events()
        new = engine.kv_publisher
        assert new is not None and new is not old
        assert new.endpoint == old.endpoint  # the same ports, as a restarted engine binds
        assert engine.model.kv.num_cached_blocks == 0
        await http.post("/v1/chat/completions", json=chat_body("fresh " * 80, max_tokens=1))
        assert await drained(new) > 0
        sockets = Sockets(new)
        try:
            replayed = sockets.replay(0)
        finally:
            sockets.close()
    assert decode_seq(replayed[0][2]) == 0
    batches = [decode_batch(f[-1]) for f in replayed[:-1]]
    assert isinstance(batches[0].events[0], AllBlocksCleared)
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    assert stored and all(e.token_ids[:4] != tuple(approx_token_ids("lost")) for e in stored)


def publish_until_heard(pub: KVEventPublisher, sockets: Sockets, batch: EventBatch) -> None:
    for _ in range(300):  # a SUB joins late: publish until it hears one
        pub.publish(batch)
        if sockets.sub.poll(20):
            return
    raise AssertionError("subscriber never joined")


def test_the_older_replay_format_a_dropped_batch_and_a_malformed_request() -> None:
    pub = KVEventPublisher(replay_endpoint="tcp://127.0.0.1:*", topic="t", replay_topic=False)
    pub.start()
    sockets = Sockets(pub)
    try:
        batch = EventBatch(time.time(), (AllBlocksCleared(),))
        publish_until_heard(pub, sockets, batch)
        while sockets.sub.poll(50):
            sockets.sub.recv_multipart()
        heard = pub.published
        pub.drop_next = 1
        pub.publish(batch)
        pub.publish(batch)
        live = sockets.live(heard + 1)
        assert [decode_seq(f[1]) for f in live] == [heard + 1]  # seq `heard` never went out
        sockets.dealer.send_multipart([b"", b"x", b"y"])  # 4 frames at the ROUTER: ignored
        replayed = sockets.replay(heard)
    finally:
        sockets.close()
        pub.stop()
    # Without the topic frame: [empty, seq, payload], and [empty, -1, empty] to end.
    assert [decode_seq(f[1]) for f in replayed[:-1]] == [heard, heard + 1]
    assert all(len(f) == 3 for f in replayed)
    assert replayed[-1] == [b"", (-1).to_bytes(8, "big", signed=True), b""]
    assert pub.replays_served == 1


def test_an_endpoint_that_cannot_be_bound_fails_start() -> None:
    first = KVEventPublisher()
    first.start()
    try:
        second = KVEventPublisher(first.endpoint)
        with pytest.raises(RuntimeError, match="cannot bind the KV event publisher"):
            second.start()
    finally:
        first.stop()
    idle = KVEventPublisher()
    idle.publish(EventBatch(0.0, ()))  # not started: dropped, not queued forever
    idle.stop()
    assert idle.published == 0
