"""vLLM 0.33's recorded frames through the real intake on loopback ZMQ, live: a batch lost
on the PUB socket is fetched from the replay endpoint; a replay endpoint that is silent or
answers garbage clears the replica instead of guessing; a restarted engine's empty cache
wipes what the gateway held; a malformed live message is counted and skipped."""

from __future__ import annotations

import asyncio

from gateway.kvevents.index import SyncState
from gateway.kvevents.tokenkeys import chain_keys, root_seed
from tests.kvevents.engine_fixtures import VLLM, Scenario, scenario
from tests.kvevents.test_kv_engine_replay import FixturePublisher, Gateway, R, until

# vllm plain: 0 stores blocks 100..131 (2 blocks), 1 stores 132..147 (1 block),
# 2 removes that block, 3 clears everything.
PLAIN = scenario(VLLM, "plain")
KEYS = chain_keys(list(range(100, 148)), 16, root_seed())


class LivePublisher(FixturePublisher):
    """The engine publishing as the test says: `buffered` batches are in its replay buffer,
    `send(i)` puts batch i on the PUB socket; its replay endpoint answers well, not at all
    ("mute") or with frames no engine sends ("garbled")."""

    def __init__(self, sc: Scenario) -> None:
        super().__init__(sc)
        self.buffered = 0
        self.mode = "ok"

    def send(self, i: int) -> None:
        self.buffered = max(self.buffered, i + 1)
        self.pub.send_multipart(self.sc.live[i])

    def _serve(self) -> None:
        *batches, end = self.sc.replay_from_0
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            client, _, start = self.router.recv_multipart()
            self.replays += 1
            if self.mode == "mute":
                continue
            if self.mode == "garbled":
                self.router.send_multipart([client, b"", b"\x00"])
                continue
            first = int.from_bytes(start, "big")
            for frames in batches[: self.buffered]:
                if int.from_bytes(frames[2], "big") >= first:
                    self.router.send_multipart([client, *frames])
            self.router.send_multipart([client, *end])


async def _joined(buffered: int, timeout_s: float = 1.0) -> tuple[LivePublisher, Gateway]:
    pub = LivePublisher(PLAIN)
    pub.buffered = buffered
    pub.start()
    gw = Gateway(PLAIN, pub)
    gw.intake.replay_timeout_s = timeout_s
    await gw.intake.start()
    await until(lambda: pub.replays >= 1)  # connected: the join asked for the history
    await asyncio.sleep(0.1)  # and the subscription has reached the PUB socket
    return pub, gw


def _matched(gw: Gateway) -> int:
    return gw.index.matched(R, KEYS, {1: 1.0})[0]


async def test_a_batch_lost_on_the_pub_socket_is_fetched_from_the_replay_buffer() -> None:
    pub, gw = await _joined(buffered=1)
    try:
        await until(lambda: _matched(gw) == 2)
        assert gw.resyncs() == {"join_replayed": 1}
        pub.buffered = 2  # the engine published batch 1, the gateway never saw it
        pub.send(2)
        await until(lambda: "gap_replayed" in gw.resyncs())
        assert gw.value("kvgate_kv_events_gaps_total") == 1
        assert gw.value("kvgate_kv_events_missed_batches_total") == 1
        # Batch 1's store came through the replay, batch 2's removal live, in that order.
        assert gw.value("kvgate_kv_events_total", type="BlockStored") == 2
        assert gw.value("kvgate_kv_events_total", type="BlockRemoved") == 1
        assert _matched(gw) == 2 and gw.feed.state(R) is SyncState.SYNCED
        pub.send(3)
        await until(lambda: _matched(gw) == 0)
        assert gw.value("kvgate_kv_events_malformed_total") == 0
    finally:
        await gw.intake.stop()
        pub.stop()


async def test_a_silent_replay_endpoint_clears_the_replica_instead_of_guessing() -> None:
    pub, gw = await _joined(buffered=1, timeout_s=0.2)
    try:
        await until(lambda: _matched(gw) == 2)
        pub.mode = "mute"
        pub.buffered = 2
        pub.send(2)  # batch 1 lost, and nobody will say what it held
        await until(lambda: "gap_cleared" in gw.resyncs())
        # What the index held may be stale now: gone, and the replica warms up again.
        assert gw.feed.state(R) is SyncState.WARMING
        assert _matched(gw) == 0
        assert gw.value("kvgate_kv_events_total", type="BlockRemoved") == 1
    finally:
        await gw.intake.stop()
        pub.stop()


async def test_a_garbled_replay_answer_is_not_read_as_history() -> None:
    pub, gw = await _joined(buffered=0)
    try:
        pub.mode = "garbled"
        pub.send(1)  # the first batch seen is not 0: the join asks for 0.. and gets junk
        await until(lambda: "join_cleared" in gw.resyncs())
        assert gw.value("kvgate_kv_events_malformed_total") == 0
        # Batch 1 alone is applied on a cleared replica: its parent is unknown, it counts.
        assert gw.value("kvgate_kv_events_total", type="BlockStored") == 1
        assert _matched(gw) == 0
        # The replay socket was closed and reopened: a good answer is read next time.
        pub.mode = "ok"
        replays = pub.replays
        pub.send(3)
        await until(lambda: pub.replays > replays)
        await until(lambda: "gap_replayed" in gw.resyncs())
    finally:
        await gw.intake.stop()
        pub.stop()


async def test_a_restarted_engine_with_an_empty_cache_wipes_what_the_gateway_held() -> None:
    pub, gw = await _joined(buffered=2)
    try:
        await until(lambda: _matched(gw) == 3)
        # The engine restarts: same address, a new process, nothing cached, nothing buffered.
        pub.buffered = 0
        replays = pub.replays
        pub.rebind_pub()
        await until(lambda: pub.replays > replays)
        await until(lambda: "reconnect_cleared" in gw.resyncs())
        assert _matched(gw) == 0 and gw.feed.state(R) is SyncState.WARMING
        # Its numbering starts again at 0, which is a complete history.
        await asyncio.sleep(0.1)
        pub.send(0)
        await until(lambda: _matched(gw) == 2)
        assert _matched(gw) == 2 and gw.feed.state(R) is SyncState.SYNCED
        assert gw.resyncs().get("start") == 1
    finally:
        await gw.intake.stop()
        pub.stop()


async def test_a_malformed_live_message_is_counted_and_skipped() -> None:
    pub, gw = await _joined(buffered=1)
    try:
        await until(lambda: _matched(gw) == 2)
        pub.pub.send_multipart([b"", b"\x00\x00\x00\x00\x00\x00\x00\x01"])  # 2 frames
        pub.pub.send_multipart([b"", (1).to_bytes(8, "big"), b"\xc1not msgpack"])
        await until(lambda: gw.value("kvgate_kv_events_malformed_total") == 2)
        pub.send(1)  # the stream goes on where it was: no gap, no resync
        await until(lambda: _matched(gw) == 3)
        assert gw.resyncs() == {"join_replayed": 1}
        assert gw.value("kvgate_kv_events_gaps_total") == 0
    finally:
        await gw.intake.stop()
        pub.stop()


def test_the_publisher_frames_are_what_the_tests_above_assume() -> None:
    assert [len(f) for f in PLAIN.live] == [3, 3, 3, 3]
    assert [int.from_bytes(f[1], "big") for f in PLAIN.live] == [0, 1, 2, 3]
