"""The intake in its own process, against the simulated engine's publisher on real ZMQ
sockets: the loop's index answers as an in-process one would, a killed intake process marks
its replicas down and is replaced, and stopping leaves no process behind."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from gateway.kvevents.feed import EventFeed
from gateway.kvevents.index import EventIndex, SyncState
from gateway.kvevents.intake import Source
from gateway.kvevents.metrics import KVEventMetrics
from gateway.kvevents.remote import RemoteIntake
from gateway.kvevents.wire import BlockRemoved, BlockStored, EventBatch
from gateway.sim.kvpublish import KVEventPublisher
from tests.kvevents.test_kv_intake import KEYS, R, W, block, until


class Rig:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.metrics = KVEventMetrics(self.registry)
        self.index = EventIndex()
        self.feed = EventFeed(self.index, self.metrics, warmup_s=3600)
        self.pub = KVEventPublisher(replay_endpoint="tcp://127.0.0.1:*")
        self.intake: RemoteIntake | None = None

    async def start(self) -> RemoteIntake:
        source = Source(R, self.pub.endpoint, self.pub.replay_endpoint, "kv-events")
        self.intake = RemoteIntake(
            (source,),
            self.feed,
            replay_timeout_s=1.0,
            restart_s=0.2,
            on_restart=self.metrics.intake_restarts.inc,
        )
        await self.intake.start()
        return self.intake

    def matched(self) -> int:
        return self.index.matched(R, KEYS, W)[0]

    def value(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    r = Rig()
    r.pub.start()
    try:
        yield r
    finally:
        if r.intake is not None:
            await r.intake.stop()
        r.pub.stop()


async def test_the_loop_index_is_fed_from_the_intake_process(rig: Rig) -> None:
    for i in range(10):  # a history before the gateway joins: replayed at once
        rig.pub.publish(EventBatch(0.0, (block(i),)))
    intake = await rig.start()
    assert intake.pid is not None and intake.pid != os.getpid()
    await until(lambda: rig.matched() == 10, timeout=20)
    assert rig.feed.state(R) is SyncState.SYNCED
    # Live batches: a store of 30 more blocks, then the last 5 of the chain evicted.
    tokens = tuple(range(160, 640))
    rig.pub.publish(EventBatch(0.0, (BlockStored(tuple(range(11, 41)), 10, tokens, 16),)))
    await until(lambda: rig.matched() == 40)
    rig.pub.publish(EventBatch(0.0, (BlockRemoved(tuple(range(40, 35, -1))),)))
    await until(lambda: rig.matched() == 35)
    r = rig.index.blocks(R)
    assert r is not None and not r.keys  # the loop keeps what lookups read, not the hashes
    assert r.by_medium == {1: 35} and r.holes == 0
    assert rig.value("kvgate_kv_events_total", replica="e0", type="BlockStored") == 11
    assert rig.value("kvgate_kv_events_batches_total", replica="e0") == 12


async def test_a_killed_intake_process_marks_down_and_is_replaced(rig: Rig) -> None:
    for i in range(5):
        rig.pub.publish(EventBatch(0.0, (block(i),)))
    intake = await rig.start()
    await until(lambda: rig.matched() == 5, timeout=20)
    first = intake.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    await until(lambda: rig.feed.state(R) is SyncState.DOWN)
    # The new process joins the stream again: the whole history is replayed, and what the
    # engine stored meanwhile is in it.
    rig.pub.publish(EventBatch(0.0, (block(5),)))
    await until(lambda: rig.matched() == 6 and rig.feed.state(R) is SyncState.SYNCED, timeout=20)
    assert intake.restarts == 1 and intake.pid != first
    assert rig.value("kvgate_kv_intake_restarts_total") == 1
    rig.pub.publish(EventBatch(0.0, (block(6),)))
    await until(lambda: rig.matched() == 7)


async def test_stopping_ends_the_intake_process(rig: Rig) -> None:
    intake = await rig.start()
    pid = intake.pid
    assert pid is not None
    await intake.stop()
    rig.intake = None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
