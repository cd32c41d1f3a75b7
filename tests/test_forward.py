"""`open_leg` and `Leg` against a real simulated engine: the peeked first chunk comes
first, the in-flight slot is released once, and the leg names its replica in the errors
its body raises (the stages relaying the body do not add it)."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from gateway.errors import GatewayError, UpstreamStalled, UpstreamStatusError
from gateway.forward import Leg, open_leg
from gateway.sim.faults import FaultConfig
from gateway.testing.servers import RunningGateway, gateway, sim_engines
from gateway.types import ReplicaId

MODEL = "kvgate-sim"
HEADERS = [(b"content-type", b"application/json")]


def _body(stream: bool) -> bytes:
    return orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "a long answer"}],
            "max_tokens": 20,
            "stream": stream,
        }
    )


async def _open(gw: RunningGateway, stream: bool, *, peek: bool = True) -> Leg:
    """A chat completion's leg to replica e0, through the gateway's own cluster and client."""
    state = gw.state
    return await open_leg(
        state.cluster,
        state.client,
        state.health,
        ReplicaId("e0"),
        "/v1/chat/completions",
        HEADERS,
        _body(stream),
        peek=peek,
    )


async def test_stream_leg_peeks_then_names_its_replica_mid_stream() -> None:
    async with sim_engines(1, "instant") as engines:
        await engines[0].set_faults(FaultConfig(stall=2))
        async with gateway(engines, timeouts={"read_s": 0.3}) as gw:
            state = gw.state
            replica = ReplicaId("e0")
            leg = await _open(gw, True)
            assert state.cluster.in_flight[replica] == 1
            peeked = leg.first
            assert peeked
            assert await leg.next_chunk() == peeked  # the peeked chunk first, once
            assert leg.first is None
            with pytest.raises(GatewayError) as caught:
                while await leg.next_chunk():
                    pass
            assert caught.value.code == "upstream_timeout"
            assert caught.value.message.startswith("replica e0: ")
            assert caught.value.message.count("replica e0: ") == 1
            await leg.aclose()
            await leg.aclose()  # idempotent: the slot is released once
            assert state.cluster.in_flight[replica] == 0


async def test_whole_body_read_and_end_of_body() -> None:
    async with sim_engines(1, "instant") as engines, gateway(engines) as gw:
        state = gw.state
        leg = await _open(gw, False)
        try:
            assert leg.first is None  # a JSON answer is not peeked
            answer = orjson.loads(await leg.read())
            assert answer["object"] == "chat.completion"
        finally:
            await leg.aclose()
        assert state.cluster.in_flight[ReplicaId("e0")] == 0


async def test_unpeeked_stream_leg_iterates_from_the_start() -> None:
    async with sim_engines(1, "instant") as engines, gateway(engines) as gw:
        leg = await _open(gw, True, peek=False)
        try:
            assert leg.first is None and leg.chunks is None
            body = b""
            while chunk := await leg.next_chunk():
                body += chunk
        finally:
            await leg.aclose()
        assert body.rstrip().endswith(b"data: [DONE]")
        assert await leg.next_chunk() == b""  # after the end, still the end


# -- the in-flight slot on every exit path ----------------------------------------------
# `open_leg` takes the replica's slot before it sends; each way out below must give it back
# (or hand it to the returned leg), or the replica looks busier with every failure.


async def test_a_refused_connection_or_a_retryable_status_frees_the_slot() -> None:
    async with sim_engines(1, "instant") as engines, gateway(engines) as gw:
        replica = ReplicaId("e0")
        for status in (502, 503, 504):
            await engines[0].set_faults(FaultConfig(error=status))
            with pytest.raises(UpstreamStatusError) as caught:
                await _open(gw, False)
            # Raised, and the answer dropped: another replica may take the request.
            assert caught.value.upstream_status == status
            assert caught.value.retryable and caught.value.status == 502
            assert gw.state.cluster.in_flight[replica] == 0
        await engines[0].set_faults(FaultConfig(refuse=True))
        with pytest.raises(GatewayError) as refused:
            await _open(gw, False)
        assert refused.value.retryable
        assert refused.value.message.startswith("replica e0: ")
        assert gw.state.cluster.in_flight[replica] == 0


async def test_a_final_5xx_hands_the_slot_to_the_leg_and_a_cancelled_send_frees_it() -> None:
    async with sim_engines(1, "instant") as engines, gateway(engines) as gw:
        await engines[0].set_faults(FaultConfig(error=500))
        leg = await _open(gw, False)
        try:
            assert leg.response.status == 500
            assert gw.state.cluster.in_flight[ReplicaId("e0")] == 1
            assert orjson.loads(await leg.read())  # the engine's own error body, relayed
        finally:
            await leg.aclose()
        replica = ReplicaId("e0")
        assert gw.state.cluster.in_flight[replica] == 0
        # A send cancelled while waiting for the headers (the client left) frees it too.
        await engines[0].set_faults(FaultConfig(slow=30.0))
        task = asyncio.create_task(_open(gw, False))
        for _ in range(200):
            if gw.state.cluster.in_flight[replica] == 1:
                break
            await asyncio.sleep(0.005)
        assert gw.state.cluster.in_flight[replica] == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert gw.state.cluster.in_flight[replica] == 0


async def test_a_stream_stalled_before_its_first_chunk_fails_inside_the_attempt() -> None:
    async with sim_engines(1, "instant") as engines:
        await engines[0].set_faults(FaultConfig(stall=0))
        health = {"canary_timeout_s": 0.2}
        async with gateway(engines, timeouts={"read_s": 0.2}, health=health) as gw:
            with pytest.raises(UpstreamStalled) as caught:
                await _open(gw, True)
            # Timed out on the peek, and the canary stalled too: the replica is to blame,
            # nothing reached a client yet, so the attempts may fail over on this error.
            assert caught.value.retryable and caught.value.status == 504
            assert caught.value.message.startswith("replica e0: ")
            assert gw.state.cluster.in_flight[ReplicaId("e0")] == 0
