"""/v1/responses through the official openai client: answers, streams, errors, and
conversations continued with `previous_response_id` (stored on one simulated replica only,
as vLLM stores them) staying on that replica while other conversations spread."""

from __future__ import annotations

import openai
import pytest

from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway, gateway
from gateway.types import EngineLoad, ReplicaId

MODEL = "kvgate-sim"


async def test_response_non_streaming(client: openai.AsyncOpenAI) -> None:
    raw = await client.responses.with_raw_response.create(
        model=MODEL, instructions="be brief", input="hello there", max_output_tokens=5
    )
    response = raw.parse()
    assert response.id.startswith("resp_") and response.status == "incomplete"
    assert len(response.output_text.split()) == 5
    assert response.usage is not None and response.usage.output_tokens == 5
    assert raw.headers["x-kvgate-replica"] in {"e0", "e1", "e2"}


async def test_response_streaming_events(client: openai.AsyncOpenAI) -> None:
    stream = await client.responses.create(
        model=MODEL, input="stream it", max_output_tokens=4, stream=True
    )
    kinds, deltas, final = [], [], None
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[0] == "response.created" and len(deltas) == 4
    assert final is not None and final.output_text == "".join(deltas)
    assert final.usage is not None and final.usage.output_tokens == 4


async def _turn(
    client: openai.AsyncOpenAI, text: str, previous: str | None, stream: bool
) -> tuple[str, str]:
    """(response id, replica) of one turn."""
    extra = {"previous_response_id": previous} if previous else {}
    raw = await client.responses.with_raw_response.create(
        model=MODEL,
        input=text,
        max_output_tokens=2,
        stream=stream,
        **extra,  # type: ignore[call-overload]
    )
    replica = raw.headers["x-kvgate-replica"]
    if not stream:
        return raw.parse().id, replica
    ids = [event.response.id async for event in raw.parse() if event.type == "response.created"]
    return ids[0], replica


async def _converse(client: openai.AsyncOpenAI, opening: str, turns: int, stream: bool) -> set[str]:
    """Replicas that served one conversation continued by `previous_response_id` (a turn on
    another replica would fail: only the one that made an answer stores it)."""
    replicas: set[str] = set()
    previous: str | None = None
    for turn in range(turns):
        previous, replica = await _turn(
            client, opening if turn == 0 else f"turn {turn}", previous, stream
        )
        replicas.add(replica)
    return replicas


@pytest.mark.parametrize("stream", [False, True])
async def test_previous_response_id_keeps_each_conversation_on_its_replica(
    client: openai.AsyncOpenAI, engines: list[SimEngine], stream: bool
) -> None:
    served = [await _converse(client, f"conversation {i} opens here", 4, stream) for i in range(9)]
    assert all(len(replicas) == 1 for replicas in served), served
    # The conversations themselves spread over the replicas.
    assert len(set().union(*served)) >= 2, served
    assert sum(len(e.responses) for e in engines) == 9 * 4


async def test_continuing_an_unknown_response_is_the_engines_404(
    client: openai.AsyncOpenAI,
) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await client.responses.create(model=MODEL, input="hi", previous_response_id="resp_nope")
    assert "resp_nope" in info.value.message


async def test_bad_responses_bodies_are_openai_errors(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model=MODEL, input=[])
    assert info.value.param == "input"
    with pytest.raises(openai.NotFoundError) as missing:
        await client.responses.create(model="no-such-model", input="hi")
    assert missing.value.code == "model_not_found"


async def test_codex_session_header_is_a_session_id(
    gw: RunningGateway, engines: list[SimEngine]
) -> None:
    """Codex sends `session_id` on its own; requests of one session stay together, although
    each opens differently (no lineage could tie them)."""
    async with openai.AsyncOpenAI(
        base_url=gw.url + "/v1",
        api_key="k",
        max_retries=0,
    ) as client:
        by_session: dict[str, set[str]] = {}
        for i in range(24):
            session = f"codex-{i % 6}"
            raw = await client.responses.with_raw_response.create(
                model=MODEL,
                input=f"unrelated prompt {i}",
                max_output_tokens=1,
                extra_headers={"session_id": session},
            )
            by_session.setdefault(session, set()).add(raw.headers["x-kvgate-replica"])
    assert all(len(r) == 1 for r in by_session.values()), by_session
    assert len(set().union(*by_session.values())) >= 2


async def test_a_continuation_stays_even_when_its_replica_is_saturated(
    engines: list[SimEngine],
) -> None:
    """A saturated replica sheds its ordinary sessions; a continuation cannot move (no other
    replica has its answer), so it is pinned there."""
    # The load is published by hand, so no scrape may overwrite it: a request to a quiet
    # replica wakes its scraper, and that read of the idle engine could land after.
    async with (
        gateway(engines, scrape={"enabled": False}) as gw,
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client,
    ):
        await _saturated_replica_keeps_its_continuation(client, gw)


async def _saturated_replica_keeps_its_continuation(
    client: openai.AsyncOpenAI, gw: RunningGateway
) -> None:
    # Other conversations first: the gateway measures the replicas' prefill speed from
    # their first tokens, and the sticky bound is in seconds of queued prefill at it.
    for k in range(9):
        await _turn(client, f"warm-up conversation {k} " * 8, None, False)
    first, replica = await _turn(client, "a conversation under load", None, False)
    cluster = gw.state.cluster
    busy = cluster.members[ReplicaId(replica)].id

    def saturate() -> None:
        cluster.publish_load(
            busy, EngineLoad(waiting=10_000, running=64, kv_usage=0.99, scraped_at=cluster.clock())
        )

    saturate()
    # The same conversation's next turn by content alone (no previous_response_id) moves...
    moved = await client.responses.with_raw_response.create(
        model=MODEL, input="a conversation under load", max_output_tokens=1
    )
    assert moved.headers["x-kvgate-replica"] != replica
    saturate()
    # ...a continuation does not.
    second, again = await _turn(client, "next", first, False)
    assert again == replica and second != first
