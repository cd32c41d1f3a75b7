"""The intake process's side of `RemoteIntake`, in this process over a real OS pipe: what
it sends is what a loop index needs to answer as the process's whole index does, resets
clear its own index too, and it returns when the gateway's end of the pipe goes away."""

from __future__ import annotations

import multiprocessing
import threading

from gateway.kvevents.feed import EventFeed
from gateway.kvevents.index import EventIndex, SyncState
from gateway.kvevents.remote import RemoteIntake, _Forward, _until_told
from gateway.kvevents.wire import AllBlocksCleared, BlockRemoved, EventBatch
from tests.kvevents.test_kv_intake import KEYS, R, W, block


class Loop:
    """The gateway's end: each message as `RemoteIntake._deliver` hands it to the feed."""

    def __init__(self) -> None:
        self.index = EventIndex()
        self.feed = EventFeed(self.index, warmup_s=3600)
        self.seen: list[str] = []

    def take(self, conn: object) -> None:
        from multiprocessing.connection import Connection

        assert isinstance(conn, Connection)
        while conn.poll(0):
            kind, *args = conn.recv()
            self.seen.append(kind)
            getattr(self.feed, kind)(*args)


def test_forwarded_deltas_answer_lookups_as_the_whole_index_does() -> None:
    recv, send = multiprocessing.Pipe(duplex=False)
    child = EventIndex()
    forward = _Forward(send, child)
    loop = Loop()
    forward.batch(R, 0, EventBatch(1.0, tuple(block(i) for i in range(8))))
    forward.batch(R, 1, EventBatch(2.0, (BlockRemoved((8, 7)),)))
    loop.take(recv)
    assert loop.seen == ["delta", "delta"]
    assert child.matched(R, KEYS, W)[0] == 6
    assert loop.index.matched(R, KEYS, W) == child.matched(R, KEYS, W)
    # A hole in the middle of the chain: both stop matching at the same block.
    forward.batch(R, 2, EventBatch(3.0, (BlockRemoved((3,)),)))
    loop.take(recv)
    assert loop.index.matched(R, KEYS, W)[0] == child.matched(R, KEYS, W)[0] == 2
    loop_blocks, child_blocks = loop.index.blocks(R), child.blocks(R)
    assert loop_blocks is not None and child_blocks is not None
    assert loop_blocks.holes == child_blocks.holes == 1
    forward.batch(R, 3, EventBatch(4.0, (AllBlocksCleared(),)))
    loop.take(recv)
    assert loop.index.matched(R, KEYS, W)[0] == child.matched(R, KEYS, W)[0] == 0


def test_the_other_sink_calls_are_forwarded_as_they_are_and_a_reset_clears_the_child() -> None:
    recv, send = multiprocessing.Pipe(duplex=False)
    child = EventIndex()
    forward = _Forward(send, child)
    loop = Loop()
    forward.batch(R, 0, EventBatch(1.0, tuple(block(i) for i in range(4))))
    forward.connection(R, False)
    forward.gap(R, 3)
    forward.malformed(R)
    forward.reset(R, False, "gap_cleared")
    forward.recovered(R, "reconnect_replayed")
    loop.take(recv)
    assert loop.seen == ["delta", "connection", "gap", "malformed", "reset", "recovered"]
    assert child.matched(R, KEYS, W)[0] == 0  # the child starts over as the loop does
    assert loop.index.matched(R, KEYS, W)[0] == 0
    assert loop.feed.state(R) is SyncState.WARMING
    # Afterwards a chain from its root is matched on both sides again.
    forward.batch(R, 4, EventBatch(2.0, tuple(block(i) for i in range(2))))
    loop.take(recv)
    assert loop.index.matched(R, KEYS, W)[0] == child.matched(R, KEYS, W)[0] == 2


def test_the_child_waits_until_told_or_until_the_gateway_is_gone() -> None:
    for how in ("stop", "close"):
        control_r, control_w = multiprocessing.Pipe(duplex=False)
        waiter = threading.Thread(target=_until_told, args=(control_r,))
        waiter.start()
        waiter.join(0.1)
        assert waiter.is_alive()
        if how == "stop":
            control_w.send("stop")
        else:
            control_w.close()
        waiter.join(2.0)
        assert not waiter.is_alive(), how


async def test_an_intake_with_no_sources_starts_no_process() -> None:
    intake = RemoteIntake((), Loop().feed)
    await intake.start()
    assert intake.pid is None
    await intake.stop()  # nothing to end
    assert intake.restarts == 0
