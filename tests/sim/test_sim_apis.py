"""The Responses API and Anthropic's Messages API on the simulated engine (gateway.sim.apis,
gateway.sim.stored), served by uvicorn on loopback and driven by the official clients."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
import pytest_asyncio
from sim_helpers import eventually, test_profile

from gateway.sim.apis import (
    anthropic_error,
    anthropic_messages,
    response_object,
    responses_messages,
)
from gateway.sim.cluster import SimCluster
from gateway.sim.faults import NO_FAULTS, FaultConfig
from gateway.sim.server import SimEngine
from gateway.sim.wire import WireError

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "kvgate-sim"
OPENING = "Here is a long shared opening that the prefix cache should keep. " * 6


class Served:
    def __init__(self, cluster: SimCluster) -> None:
        self.cluster = cluster
        self.url = cluster.urls[0]
        self.engine: SimEngine = cluster.engines[0]
        self.oai = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="-", max_retries=0)
        self.claude = anthropic.AsyncAnthropic(base_url=self.url, api_key="-", max_retries=0)
        self.http = httpx.AsyncClient(base_url=self.url, timeout=10)

    async def aclose(self) -> None:
        await self.oai.close()
        await self.claude.close()
        await self.http.aclose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served() -> AsyncIterator[Served]:
    async with SimCluster(1, test_profile(num_gpu_blocks=256, max_model_len=4096)) as cluster:
        s = Served(cluster)
        try:
            yield s
        finally:
            await s.aclose()


# ---- Responses ------------------------------------------------------------------------------


async def test_a_response_continues_by_previous_response_id_with_a_cached_prefix(
    served: Served,
) -> None:
    first = await served.oai.responses.create(
        model=MODEL, input=OPENING, instructions="be brief", max_output_tokens=4
    )
    assert first.id.startswith("resp_") and first.status == "incomplete"
    assert first.incomplete_details is not None
    assert first.incomplete_details.reason == "max_output_tokens"
    assert first.usage is not None and first.usage.output_tokens == 4
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert first.output_text and len(first.output_text.split()) == 4
    second = await served.oai.responses.create(
        model=MODEL,
        input="and then?",
        previous_response_id=first.id,
        instructions="be brief",
        max_output_tokens=3,
    )
    assert second.previous_response_id == first.id
    assert second.usage is not None
    # The continuation renders the stored turns first: their blocks are cache hits.
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16
    again = await served.oai.responses.retrieve(second.id)
    assert again.id == second.id and again.output_text == second.output_text
    assert again.usage is not None and again.usage.output_tokens == 3


async def test_input_items_tool_outputs_and_content_parts(served: Served) -> None:
    items: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "input_text", "text": "look this up"}]},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
    ]
    reply = await served.http.post(
        "/v1/responses", json={"model": MODEL, "input": items, "max_output_tokens": 2}
    )
    assert reply.status_code == 200
    body = reply.json()
    assert body["object"] == "response" and body["output"][0]["type"] == "message"
    assert body["usage"]["total_tokens"] == (
        body["usage"]["input_tokens"] + body["usage"]["output_tokens"]
    )


async def test_store_false_is_not_kept_and_unknown_ids_are_404(served: Served) -> None:
    answer = await served.oai.responses.create(
        model=MODEL, input="forget me", store=False, max_output_tokens=2
    )
    assert answer.store is False
    with pytest.raises(openai.NotFoundError) as gone:
        await served.oai.responses.retrieve(answer.id)
    assert answer.id in gone.value.response.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        await served.oai.responses.create(
            model=MODEL, input="x", previous_response_id="resp_nope", max_output_tokens=2
        )
    with pytest.raises(openai.NotFoundError):
        await served.oai.responses.cancel("resp_nope")


async def test_a_synchronous_response_cannot_be_cancelled_nor_streamed_back(
    served: Served,
) -> None:
    done = await served.oai.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as refused:
        await served.oai.responses.cancel(done.id)
    assert "synchronous" in refused.value.response.json()["error"]["message"]
    streamed = await served.http.get(f"/v1/responses/{done.id}", params={"stream": "true"})
    assert streamed.status_code == 400
    assert streamed.json()["error"]["param"] == "stream"
    assert ("POST", f"/v1/responses/{done.id}/cancel") in served.engine.lifecycle_log


async def test_background_responses_queue_finish_and_cancel(served: Served) -> None:
    queued = await served.oai.responses.create(
        model=MODEL, input="in the background", background=True, max_output_tokens=3
    )
    assert queued.status == "queued" and queued.background is True
    assert queued.output == [] and queued.usage is None

    async def status(rid: str) -> str:
        return str((await served.oai.responses.retrieve(rid)).status)

    for _ in range(200):
        if await status(queued.id) not in ("queued", "in_progress"):
            break
        await asyncio.sleep(0.01)
    finished = await served.oai.responses.retrieve(queued.id)
    assert finished.status == "incomplete" and finished.usage is not None
    assert finished.usage.output_tokens == 3
    # A long one is cancelled while it runs: it stays cancelled, and its blocks are freed.
    long = await served.oai.responses.create(
        model=MODEL,
        input="a long background answer",
        background=True,
        max_output_tokens=2000,
    )
    await eventually(lambda: served.engine.model.num_running == 1)
    cancelled = await served.oai.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    await eventually(lambda: served.engine.model.num_running == 0)
    assert await status(long.id) == "cancelled"
    assert served.engine.blocks_in_use == 0
    with pytest.raises(openai.BadRequestError):
        await served.oai.responses.cancel(long.id)  # no longer queued or in progress


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"store": False}, "background"), ({"stream": True}, "stream")],
)
async def test_background_needs_store_and_no_stream(
    served: Served, extra: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "input": "x", "background": True, **extra}
    reply = await served.http.post("/v1/responses", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == param


async def test_a_streamed_response_numbers_its_events_and_is_stored(served: Served) -> None:
    stream = await served.oai.responses.create(
        model=MODEL, input="stream this", max_output_tokens=5, stream=True
    )
    events = [e async for e in stream]
    names = [e.type for e in events]
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names.count("response.output_text.delta") == 5
    assert names[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == deltas
    stored = await served.oai.responses.retrieve(final.id)
    assert stored.output_text == deltas


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"input": 5}, 400, "'input' must be"),
        ({"input": []}, 400, "'input' is empty"),
        ({"input": ["not an object"]}, 400, "each 'input' item"),
        ({"input": "x", "previous_response_id": 7}, 400, "previous_response_id"),
        ({"input": "x", "model": "other"}, 404, "does not exist"),
        ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ],
)
async def test_bad_responses_bodies_get_openai_errors(
    served: Served, body: dict[str, Any], status: int, fragment: str
) -> None:
    reply = await served.http.post("/v1/responses", json={"model": MODEL, **body})
    assert reply.status_code == status
    error = reply.json()["error"]
    assert fragment in error["message"] and error["code"] == status


async def test_responses_messages_order_instructions_history_and_input() -> None:
    history = {"resp_1": ({"role": "system", "content": "old"}, {"role": "user", "content": "a"})}
    out = responses_messages(
        {"instructions": "new", "previous_response_id": "resp_1", "input": "b"}, history.get
    )
    assert out == [
        {"role": "system", "content": "new"},
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
    ]
    # A continuation with no new input is the stored conversation alone.
    assert responses_messages({"previous_response_id": "resp_1"}, history.get) == [
        {"role": "user", "content": "a"}
    ]
    with pytest.raises(WireError) as missing:
        responses_messages({"previous_response_id": "resp_2", "input": "b"}, history.get)
    assert missing.value.status == 404


async def test_a_pending_response_object_has_no_output_nor_usage() -> None:
    pending = response_object("resp_x", MODEL, {}, text=None, finish_reason=None)
    assert pending["status"] == "in_progress" and pending["usage"] is None
    assert pending["output"] == [] and pending["store"] is True
    done = response_object(
        "resp_x", MODEL, {"store": False}, text="hi", finish_reason="stop", prompt_tokens=3
    )
    assert done["status"] == "completed" and done["incomplete_details"] is None
    assert done["output"][0]["id"] == "msg_x" and done["store"] is False
    assert done["usage"]["total_tokens"] == 3


# ---- Anthropic Messages ---------------------------------------------------------------------


async def test_messages_through_the_anthropic_client_agree_with_count_tokens(
    served: Served,
) -> None:
    messages: list[anthropic.types.MessageParam] = [{"role": "user", "content": OPENING}]
    counted = await served.claude.messages.count_tokens(
        model=MODEL, system="be brief", messages=messages
    )
    first = await served.claude.messages.create(
        model=MODEL, system="be brief", messages=messages, max_tokens=4
    )
    second = await served.claude.messages.create(
        model=MODEL, system="be brief", messages=messages, max_tokens=4
    )
    assert first.id.startswith("msg_") and first.stop_reason == "max_tokens"
    assert first.content[0].type == "text" and len(first.content[0].text.split()) == 4
    total = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert total == counted.input_tokens
    # The same prompt again: its whole blocks are read from the cache, the rest is input.
    cached = second.usage.cache_read_input_tokens or 0
    assert cached == (counted.input_tokens - 1) // 16 * 16 > 0
    assert second.usage.input_tokens == counted.input_tokens - cached
    assert served.engine.request_log[-3].endpoint == "count_tokens"


async def test_a_streamed_message_has_the_api_event_sequence(served: Served) -> None:
    async with served.claude.messages.stream(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "stream"}]}],
        max_tokens=3,
    ) as stream:
        kinds = [e.type async for e in stream]
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_delta") == 3 or kinds.count("text") == 3
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 3
    assert len(final.content[0].text.split()) == 3  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error"),
        ({"messages": [], "max_tokens": 2}, 400, "invalid_request_error"),
        (
            {"model": "other", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
            404,
            "not_found_error",
        ),
    ],
)
async def test_bad_messages_get_anthropic_errors(
    served: Served, body: dict[str, Any], status: int, kind: str
) -> None:
    reply = await served.http.post("/v1/messages", json={"model": MODEL, **body})
    assert reply.status_code == status
    assert reply.json()["type"] == "error" and reply.json()["error"]["type"] == kind


async def test_count_tokens_errors_and_faults_speak_anthropic(served: Served) -> None:
    wrong = await served.http.post(
        "/v1/messages/count_tokens",
        json={"model": "other", "messages": [{"role": "user", "content": "x"}]},
    )
    assert wrong.status_code == 404 and wrong.json()["error"]["type"] == "not_found_error"
    empty = await served.http.post("/v1/messages/count_tokens", json={"messages": []})
    assert empty.status_code == 400
    await served.cluster.set_faults(0, FaultConfig(error=503))
    try:
        with pytest.raises(anthropic.InternalServerError) as overloaded:
            await served.claude.messages.count_tokens(
                model=MODEL, messages=[{"role": "user", "content": "x"}]
            )
        assert overloaded.value.status_code == 503
        assert overloaded.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    finally:
        await served.cluster.set_faults(0, NO_FAULTS)


async def test_anthropic_pieces_map_statuses_and_system_prompts() -> None:
    assert orjson.loads(anthropic_error(429, "slow"))["error"]["type"] == "rate_limit_error"
    assert orjson.loads(anthropic_error(418, "tea"))["error"]["type"] == "api_error"
    out = anthropic_messages(
        {
            "system": [{"type": "text", "text": "sys"}],
            "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            "max_tokens": 1,
        }
    )
    assert out[0] == {"role": "system", "content": "sys"}
    assert out[1]["content"] == '{"type":"image","source":{}}'  # non-text parts as JSON
    assert anthropic_messages({"messages": [{"role": "user", "content": "x"}]}, budget=False)
    with pytest.raises(WireError):
        anthropic_messages({"messages": [{"role": "user"}], "max_tokens": True})
