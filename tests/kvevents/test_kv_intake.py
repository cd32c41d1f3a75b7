"""The intake on real ZMQ sockets against the simulated engine's publisher: batches in
order, gaps counted and replayed (or cleared without a replay endpoint), a restarted
publisher resets the replica, a dead one marks it down."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from prometheus_client import CollectorRegistry

from gateway.kvevents.feed import EventFeed
from gateway.kvevents.index import EventIndex, SyncState
from gateway.kvevents.intake import EventIntake, Source
from gateway.kvevents.metrics import KVEventMetrics
from gateway.kvevents.tokenkeys import chain_keys, root_seed
from gateway.kvevents.wire import BlockRemoved, BlockStored, EventBatch
from gateway.sim.kvpublish import KVEventPublisher
from gateway.types import ReplicaId

R = ReplicaId("e0")
W = {1: 1.0}


async def until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


def block(i: int) -> BlockStored:
    """Block i of one long chain (tokens 16i..16i+15), engine hash i+1."""
    return BlockStored(
        (i + 1,), i if i else None, tuple(range(16 * i, 16 * i + 16)), 16, None, "GPU"
    )


KEYS = chain_keys(list(range(16 * 40)), 16, root_seed())


class Rig:
    def __init__(self, replay: bool) -> None:
        self.replay = replay
        self.registry = CollectorRegistry()
        self.metrics = KVEventMetrics(self.registry)
        self.index = EventIndex()
        self.feed = EventFeed(self.index, self.metrics, warmup_s=3600)
        self.pub = KVEventPublisher(replay_endpoint="tcp://127.0.0.1:*" if replay else None)
        self.intake: EventIntake | None = None
        self.sent = 0

    async def start(self) -> None:
        self.pub.start()
        source = Source(R, self.pub.endpoint, self.pub.replay_endpoint, "kv-events")
        self.intake = EventIntake((source,), self.feed, replay_timeout_s=0.5)
        await self.intake.start()
        # PUB/SUB joins late: publish one batch until the subscriber has it.
        await self.send_until_seen()

    async def send_until_seen(self) -> None:
        """Without a replay endpoint what the late join lost stays lost: the chain's root
        is then re-sent until it arrives (the index cannot place blocks after a loss)."""
        for _ in range(200):
            if self.replay or self.sent == 0:
                self.send()
            else:
                self.pub.publish(EventBatch(0.0, (block(0),)))
            await asyncio.sleep(0.02)
            if self.matched() >= (self.sent if self.replay else 1):
                self.sent = max(self.sent, self.matched())
                return
        raise AssertionError("subscriber never joined")

    def send(self, n: int = 1) -> None:
        for _ in range(n):
            self.pub.publish(EventBatch(0.0, (block(self.sent),)))
            self.sent += 1

    def matched(self) -> int:
        return self.index.matched(R, KEYS, W)[0]

    def value(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, {"replica": "e0", **labels}) or 0.0


@pytest.fixture
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    r = Rig(replay=request.param)
    await r.start()
    try:
        yield r
    finally:
        assert r.intake is not None
        await r.intake.stop()
        r.pub.stop()


@pytest.mark.parametrize("rig", [True], indirect=True)
async def test_a_joining_subscriber_replays_from_zero_and_is_synced(rig: Rig) -> None:
    # The late join lost the first batches; the replay filled them in.
    assert rig.matched() == rig.sent
    assert rig.feed.state(R) is SyncState.SYNCED
    rig.send(3)
    await until(lambda: rig.matched() == rig.sent)


@pytest.mark.parametrize("rig", [True], indirect=True)
async def test_a_gap_is_counted_and_replayed(rig: Rig) -> None:
    before = rig.sent
    rig.pub.drop_next = 2
    rig.send(3)
    await until(lambda: rig.matched() == rig.sent)
    assert rig.value("kvgate_kv_events_gaps_total") == 1
    assert rig.value("kvgate_kv_events_missed_batches_total") == 2
    assert rig.value("kvgate_kv_events_resyncs_total", reason="gap_replayed") == 1
    assert rig.feed.state(R) is SyncState.SYNCED
    assert rig.sent == before + 3


@pytest.mark.parametrize("rig", [False], indirect=True)
async def test_without_replay_a_gap_clears_and_warms(rig: Rig) -> None:
    rig.pub.drop_next = 1
    rig.send(2)
    await until(lambda: rig.value("kvgate_kv_events_gaps_total") == 1)
    await until(lambda: rig.feed.state(R) is SyncState.WARMING)
    # The index restarted: the block after the gap has a parent it never saw.
    assert rig.matched() == 0
    assert rig.value("kvgate_kv_events_resyncs_total", reason="gap_cleared") == 1


@pytest.mark.parametrize("rig", [True], indirect=True)
async def test_a_dead_publisher_marks_down_and_a_new_one_resets(rig: Rig) -> None:
    endpoint, replay = rig.pub.endpoint, rig.pub.replay_endpoint
    rig.pub.stop()
    await until(lambda: rig.feed.state(R) is SyncState.DOWN)
    assert rig.value("kvgate_kv_events_disconnects_total") == 1
    # The engine comes back on the same ports, numbering from 0 with an empty cache.
    rig.pub = KVEventPublisher(endpoint, replay)
    rig.pub.start()
    rig.sent = 0
    for _ in range(200):
        rig.send()
        await asyncio.sleep(0.02)
        if rig.feed.state(R) is SyncState.SYNCED and rig.matched() == rig.sent:
            break
    # The old engine's blocks are gone from the index; the new chain is whole (replayed).
    assert rig.feed.state(R) is SyncState.SYNCED and rig.matched() == rig.sent
    rig.send(2)
    await until(lambda: rig.matched() == rig.sent)
    resets = sum(
        rig.value("kvgate_kv_events_resyncs_total", reason=r)
        for r in ("reset", "reset_replayed", "reconnect_replayed", "start")
    )
    assert resets >= 1


@pytest.mark.parametrize("rig", [True], indirect=True)
async def test_malformed_messages_are_counted_and_skipped(rig: Rig) -> None:
    import zmq

    # A second publisher on another port would not reach this subscriber; inject through
    # the same PUB by publishing raw bytes the way a broken engine would.
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUB)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        source = Source(ReplicaId("bad"), f"tcp://127.0.0.1:{port}")
        intake = EventIntake((source,), rig.feed)
        await intake.start()
        try:
            for _ in range(100):
                sock.send_multipart([b"kv-events", b"\x00" * 8, b"\xc1"])
                await asyncio.sleep(0.02)
                if rig.registry.get_sample_value(
                    "kvgate_kv_events_malformed_total", {"replica": "bad"}
                ):
                    break
            assert rig.registry.get_sample_value(
                "kvgate_kv_events_malformed_total", {"replica": "bad"}
            )
        finally:
            await intake.stop()
            sock.close(0)
    finally:
        ctx.term()


async def test_joining_an_idle_engine_replays_its_whole_history_at_once() -> None:
    """A gateway joining an engine that has run a while (here 300 16K-token prompts stored,
    then evicted) and is idle now replays its whole buffer on connecting, without waiting
    for the engine's next batch, and is synced. (That the loop keeps serving meanwhile is
    the inbox's test: tests/kvevents/test_kv_inbox.py.)"""
    rig = Rig(replay=True)
    rig.pub.start()
    flood = 300
    for k in range(flood):
        hashes = tuple(range(10**6 * (k + 1), 10**6 * (k + 1) + 1024))
        rig.pub.publish(EventBatch(0.0, (BlockStored(hashes, None, tuple(range(16384)), 16),)))
        rig.pub.publish(EventBatch(0.0, (BlockRemoved(hashes),)))
    await until(lambda: rig.pub.published == 2 * flood)  # sent before anyone listened
    source = Source(R, rig.pub.endpoint, rig.pub.replay_endpoint, "kv-events")
    rig.intake = EventIntake((source,), rig.feed, replay_timeout_s=2.0)
    try:
        await rig.intake.start()
        await until(lambda: rig.value("kvgate_kv_events_batches_total") == 2 * flood)
        assert rig.value("kvgate_kv_events_resyncs_total", reason="join_replayed") == 1
        assert rig.feed.state(R) is SyncState.SYNCED
        blocks = rig.index.blocks(R)
        assert blocks is not None and not blocks.keys  # the flood came and went
        # Live batches continue the replayed history.
        await rig.send_until_seen()
        assert rig.matched() == rig.sent
        assert rig.value("kvgate_kv_events_resyncs_total", reason="join_replayed") == 1
        assert rig.value("kvgate_kv_events_gaps_total") == 0
        assert rig.value("kvgate_kv_events_resyncs_total", reason="reconnect_replayed") == 0
    finally:
        await rig.intake.stop()
        rig.pub.stop()


async def test_joining_past_a_rolled_buffer_warms_instead_of_replaying_part() -> None:
    rig = Rig(replay=True)
    rig.pub = KVEventPublisher(replay_endpoint="tcp://127.0.0.1:*", buffer_steps=4)
    rig.pub.start()
    for k in range(10):  # batches 0..5 are gone from the buffer
        rig.pub.publish(EventBatch(0.0, (BlockStored((10**6 + k,), None, tuple(range(16)), 16),)))
    await until(lambda: rig.pub.published == 10)
    source = Source(R, rig.pub.endpoint, rig.pub.replay_endpoint, "kv-events")
    rig.intake = EventIntake((source,), rig.feed, replay_timeout_s=0.5)
    try:
        await rig.intake.start()
        for _ in range(200):  # until a live batch arrives and asks for the replay
            rig.pub.publish(EventBatch(0.0, (block(0),)))
            await asyncio.sleep(0.02)
            if rig.value("kvgate_kv_events_resyncs_total", reason="join_cleared"):
                break
        assert rig.value("kvgate_kv_events_resyncs_total", reason="join_cleared") == 1
        assert rig.value("kvgate_kv_events_resyncs_total", reason="join_replayed") == 0
        await until(lambda: rig.feed.state(R) is SyncState.WARMING)
        # None of the partial history was applied: only live batches from then on.
        blocks = rig.index.blocks(R)
        assert blocks is not None and not any(h >= 10**6 for h in blocks.keys)
        # Asked once, on connecting; the first batch did not fetch the buffer again.
        assert rig.pub.replays_served == 1
    finally:
        await rig.intake.stop()
        rig.pub.stop()
