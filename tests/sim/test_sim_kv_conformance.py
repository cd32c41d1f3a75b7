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


async def test_vllm_flavor_serves_kv_event_sources_as_vllm_does() -> None:
    import httpx

    from gateway.sim.server import KVEventsOptions
    from gateway.testing.servers import sim_engines
    from tests.kvevents.engine_fixtures import load

    real = load(VLLM, "http.json")["kv_event_sources"]["0"]
    async with (
        sim_engines(1, kv_events=KVEventsOptions()) as (engine,),
        httpx.AsyncClient() as client,
    ):
        body = (await client.get(engine.url + "/kv_event_sources")).json()
    assert set(body) == {"0"}
    assert set(body["0"]) == set(real)
    assert {k: type(v) for k, v in body["0"].items()} == {k: type(v) for k, v in real.items()}


async def test_sglang_flavor_keeps_metrics_off_unless_enabled_and_describes_its_events() -> None:
    import httpx

    from gateway.sim.server import KVEventsOptions
    from gateway.testing.servers import sim_engines
    from tests.kvevents.engine_fixtures import SGLANG, load

    defaults = load(SGLANG, "metrics.json")["server_args_defaults"]
    async with (
        sim_engines(
            1,
            flavor="sglang",
            metrics_enabled=defaults["enable_metrics"],
            kv_events=KVEventsOptions(),
        ) as (engine,),
        httpx.AsyncClient() as client,
    ):
        metrics = await client.get(engine.url + "/metrics")
        info = (await client.get(engine.url + "/server_info")).json()
    assert metrics.status_code == 404
    assert info["enable_metrics"] is False
    assert info["schedule_low_priority_values_first"] is False
    kv = info["kv_events"]
    # The descriptor's keys, as SGLang 0.5.23's describe_kv_events_publisher writes them.
    assert set(kv) == {
        "publisher",
        "endpoint_host",
        "endpoint_port_base",
        "topic",
        "block_size",
        "dp_size",
        "replay_endpoint_port_base",
    }
    assert engine.kv_publisher is not None
    assert engine.kv_publisher.endpoint.endswith(f":{kv['endpoint_port_base']}")


def test_cli_flavors_map_to_the_releases() -> None:
    import argparse

    from gateway.sim.cli import add_arguments, cluster_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    off = cluster_from_args(parser.parse_args(["--flavor", "sglang-0.5.23"]))
    on = cluster_from_args(parser.parse_args(["--flavor", "sglang-0.5.23", "--enable-metrics"]))
    v = cluster_from_args(parser.parse_args(["--flavor", "vllm-0.33"]))
    assert (off.engines[0].flavor, off.engines[0].metrics_enabled) == ("sglang", False)
    assert on.engines[0].metrics_enabled
    assert (v.engines[0].flavor, v.engines[0].metrics_enabled) == ("vllm", True)
