"""The simulated engine's KV event stream against what the engines' own publishers sent
(tests/fixtures/engines): the same frames on the PUB and the replay ROUTER, the same batch
shape. If the twin drifts from the recorded engines, this fails."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from gateway.kvevents.wire import BlockStored, EventBatch
from gateway.sim.kvpublish import KVEventPublisher
from tests.kvevents.engine_fixtures import ENGINES, VLLM, scenario, scenarios


def _sim_frames() -> tuple[list[list[bytes]], list[list[bytes]]]:
    pub = KVEventPublisher(replay_endpoint="tcp://127.0.0.1:*", topic="")
    pub.start()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint or "")
    try:
        live: list[list[bytes]] = []
        stored = BlockStored((1, 2), None, tuple(range(32)), 16, None, "GPU")
        for _ in range(300):  # a SUB joins late: publish until it hears one
            pub.publish(EventBatch(time.time(), (stored,), 0))
            if sub.poll(20):
                live.append(sub.recv_multipart())
                break
        assert live, "subscriber never joined"
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replay: list[list[bytes]] = []
        while dealer.poll(2000):
            frames = dealer.recv_multipart()
            replay.append(frames)
            if frames[-2] == (-1).to_bytes(8, "big", signed=True):
                break
        return live, replay
    finally:
        sub.close(0)
        dealer.close(0)
        ctx.term()
        pub.stop()


@pytest.mark.parametrize("engine", ENGINES)
def test_sim_frames_are_the_engines_frames(engine: str) -> None:
    live, replay = _sim_frames()
    real = scenarios(engine)[0]
    assert [len(f) for f in live] == [len(f) for f in real.live[:1]]
    assert len(replay[0]) == len(real.replay_from_0[0]) == 4
    assert replay[-1] == real.replay_from_0[-1]  # the end marker, byte for byte
    # The replay repeats the live message after [empty, topic].
    assert replay[-2][0] == b"" and replay[-2][1:] == live[0]


def test_sim_batches_have_the_engines_shape() -> None:
    live, _ = _sim_frames()
    ts, events, rank = msgspec.msgpack.decode(live[0][2])
    rts, revents, rrank = msgspec.msgpack.decode(scenario(VLLM, "plain").live[0][2])
    assert type(ts) is type(rts) and type(rank) is type(rrank)
    sim, real = events[0], revents[0]
    assert sim["type"] == real["type"] == "BlockStored"
    # Every field the twin sends, the engine sends under the same name and type.
    assert set(sim) <= set(real)
    assert all(type(sim[k]) is type(real[k]) for k in sim if real[k] is not None)
