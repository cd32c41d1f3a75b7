"""Stored Responses through the official openai client: retrieve, cancel, delete and
input_items each reach the one simulated replica that stored the answer (as vLLM keeps
them), unknown ids are OpenAI's 404, and an id whose placement the gateway lost is found
by asking the replicas."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import openai
import pytest

from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway, gateway, sim_engines

MODEL = "kvgate-sim"


@pytest.fixture
async def engines() -> AsyncIterator[list[SimEngine]]:
    async with sim_engines(4, "instant") as engines:
        yield engines


def _gets(engines: list[SimEngine], response_id: str) -> list[int]:
    """How many times each engine was asked for `response_id`."""
    path = f"/v1/responses/{response_id}"
    return [sum(1 for m, p in e.lifecycle_log if m == "GET" and p == path) for e in engines]


async def _create(client: openai.AsyncOpenAI, i: int, stream: bool) -> tuple[str, str, str]:
    """(id, replica, text) of one answer."""
    raw = await client.responses.with_raw_response.create(
        model=MODEL,
        input=f"conversation {i} starts here",
        max_output_tokens=3,
        stream=stream,  # type: ignore[call-overload]
    )
    replica = raw.headers["x-kvgate-replica"]
    if not stream:
        parsed = raw.parse()
        return parsed.id, replica, parsed.output_text
    final = [e.response async for e in raw.parse() if e.type.startswith("response.incomplete")]
    return final[0].id, replica, final[0].output_text


def _idle(gw: RunningGateway) -> bool:
    return all(n == 0 for n in gw.state.cluster.in_flight.values())


async def test_each_response_is_retrieved_from_the_replica_that_stored_it(
    client: openai.AsyncOpenAI, engines: list[SimEngine], gw: RunningGateway
) -> None:
    made = [await _create(client, i, stream=i % 2 == 1) for i in range(24)]
    assert len({replica for _, replica, _ in made}) >= 3  # the answers spread
    for response_id, replica, text in made:
        raw = await client.responses.with_raw_response.retrieve(response_id)
        response = raw.parse()
        assert response.id == response_id and response.output_text == text
        assert response.status == "incomplete"  # max_output_tokens reached
        assert raw.headers["x-kvgate-replica"] == replica
        # Only the storing engine was asked: the placement was recorded as the answer passed.
        asked = _gets(engines, response_id)
        assert asked[int(replica[1:])] == 1 and sum(asked) == 1
    assert _idle(gw)


async def test_unknown_id_is_openais_404(
    client: openai.AsyncOpenAI, engines: list[SimEngine]
) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await client.responses.retrieve("resp_0123456789abcdef")
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["message"] == "Response with id 'resp_0123456789abcdef' not found."
    assert body["type"] == "invalid_request_error" and body["param"] == "response_id"
    assert "x-kvgate-replica" not in caught.value.response.headers  # the gateway's own answer
    # No placement, so every replica was asked; none had it.
    assert _gets(engines, "resp_0123456789abcdef") == [1, 1, 1, 1]
    for call in (client.responses.cancel, client.responses.delete):
        with pytest.raises(openai.NotFoundError):
            await call("resp_0123456789abcdef")


async def test_without_locate_an_unknown_id_asks_no_replica(engines: list[SimEngine]) -> None:
    async with (
        gateway(engines, responses={"locate": False}) as gw,
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client,
    ):
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve("resp_feedface")
    assert _gets(engines, "resp_feedface") == [0, 0, 0, 0]


async def test_a_lost_placement_is_found_by_asking_the_replicas(
    client: openai.AsyncOpenAI, engines: list[SimEngine]
) -> None:
    made = [await _create(client, i, stream=False) for i in range(8)]
    # A second gateway (another instance, or this one restarted) has no placements.
    async with (
        gateway(engines) as other,
        openai.AsyncOpenAI(base_url=other.url + "/v1", api_key="k", max_retries=0) as fresh,
    ):
        for response_id, replica, text in made:
            for _ in range(2):
                raw = await fresh.responses.with_raw_response.retrieve(response_id)
                assert raw.parse().output_text == text
                assert raw.headers["x-kvgate-replica"] == replica
            # The first retrieve asked the replicas (found on the owner, then recorded) and
            # went to the owner; the second one went to the owner only.
            asked = _gets(engines, response_id)
            assert asked[int(replica[1:])] == 3 and sum(asked) <= 6
        # The placement found is the continuation's too.
        response_id, replica, _ = made[0]
        raw = await fresh.responses.with_raw_response.create(
            model=MODEL, input="go on", max_output_tokens=2, previous_response_id=response_id
        )
        assert raw.headers["x-kvgate-replica"] == replica


async def test_cancel_of_a_finished_response_is_the_engines_400(
    client: openai.AsyncOpenAI,
) -> None:
    response_id, _, _ = await _create(client, 0, stream=False)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.cancel(response_id)
    body = caught.value.body
    assert isinstance(body, dict) and body["message"] == "Cannot cancel a synchronous response."


async def test_delete_and_input_items_reach_the_owner_and_relay_its_refusal(
    client: openai.AsyncOpenAI, engines: list[SimEngine]
) -> None:
    # vLLM serves neither: its answer (405, 404) is relayed from the replica that has the id.
    made = [await _create(client, i, stream=False) for i in range(6)]
    for response_id, replica, _ in made:
        with pytest.raises(openai.APIStatusError) as deleting:
            await client.responses.delete(response_id)
        assert deleting.value.status_code == 405
        assert deleting.value.response.headers["x-kvgate-replica"] == replica
        with pytest.raises(openai.NotFoundError) as listing:
            await client.responses.input_items.list(response_id)
        assert listing.value.response.headers["x-kvgate-replica"] == replica
        # Still stored: DELETE changed nothing there.
        assert (await client.responses.retrieve(response_id)).id == response_id


async def _until(client: openai.AsyncOpenAI, response_id: str, statuses: set[str]) -> str:
    for _ in range(400):
        status = (await client.responses.retrieve(response_id)).status
        assert status is not None
        if status in statuses:
            return status
        await asyncio.sleep(0.01)
    raise AssertionError(f"{response_id} never reached {statuses}")


async def test_background_responses_complete_or_are_cancelled_on_their_replica() -> None:
    async with (
        sim_engines(3, "h200-sparse") as engines,
        gateway(engines) as gw,
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client,
    ):
        short = await client.responses.with_raw_response.create(
            model=MODEL, input="quick one", max_output_tokens=4, background=True
        )
        queued = short.parse()
        assert queued.status == "queued" and queued.background
        assert await _until(client, queued.id, {"completed", "incomplete"}) == "incomplete"
        done = await client.responses.retrieve(queued.id)
        assert done.usage is not None and done.usage.output_tokens == 4

        long = await client.responses.with_raw_response.create(
            model=MODEL, input="a long one", max_output_tokens=2000, background=True
        )
        owner = engines[int(long.headers["x-kvgate-replica"][1:])]
        response_id = long.parse().id
        await _until(client, response_id, {"in_progress"})
        cancelled = await client.responses.cancel(response_id)
        assert cancelled.status == "cancelled"
        assert (await client.responses.retrieve(response_id)).status == "cancelled"
        # The engine stopped generating it, well before its token budget.
        rid = long.headers["x-request-id"]
        record = next(r for r in owner.request_log if r.request_id == rid)
        assert record.output_tokens < 2000
        assert [m for m, p in owner.lifecycle_log if p.endswith("/cancel")] == ["POST"]
        with pytest.raises(openai.BadRequestError):
            await client.responses.cancel(response_id)  # cancelled already
        assert _idle(gw)
