"""A placement is announced once: the router (and the lineage index) hear of a request's
replica when its attempt is sent, and again only when another replica serves it (a PD
hand-off), never twice for the same one."""

from __future__ import annotations

import openai

from gateway.proxy.decide import place
from gateway.proxy.exchange import Exchange
from gateway.testing.servers import RunningGateway
from gateway.types import ReplicaId, RouteRequest, SessionKey

MODEL = "kvgate-sim"


async def test_router_hears_of_each_request_once(
    gw: RunningGateway, client: openai.AsyncOpenAI
) -> None:
    heard: list[tuple[str, ReplicaId]] = []
    gw.state.router_placed = lambda request, replica: heard.append((request.request_id, replica))
    for i in range(4):
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=2
        )
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
    )
    async for _ in stream:
        pass
    assert len(heard) == 5
    assert len({request_id for request_id, _ in heard}) == 5


async def test_place_tells_again_only_for_another_replica(gw: RunningGateway) -> None:
    state = gw.state
    heard: list[ReplicaId] = []
    state.router_placed = lambda request, replica: heard.append(replica)
    ex = Exchange({"type": "http"}, _never, _never, None, "r1", 0.0, 0.0)  # type: ignore[arg-type]
    request = RouteRequest(request_id="r1", model=MODEL, session_key=SessionKey("s"))
    place(state, ex, request, ReplicaId("e0"))
    place(state, ex, request, ReplicaId("e0"))  # the attempt's replica served it
    assert heard == ["e0"]
    place(state, ex, request, ReplicaId("e1"))  # a hand-off: served from another replica
    assert heard == ["e0", "e1"] and ex.placed_on == "e1"


async def _never(*_: object) -> None:
    raise AssertionError("not called")
