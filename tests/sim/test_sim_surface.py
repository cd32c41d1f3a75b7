"""The simulated engine's HTTP surface beyond generation (gateway.sim.server,
gateway.sim.middleware, gateway.sim.generate): model cards, LoRA names, admin and state
endpoints, PD endpoints with nothing to hand over, bad generation bodies answered as vLLM
answers them (through the official `openai` client), cache salts, usage streaming, and an
engine loop that dies under running requests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import orjson
import pytest
import pytest_asyncio
from sim_helpers import chat_body, eventually, test_profile

from gateway.sim.cluster import SimCluster
from gateway.sim.engine import EngineModel
from gateway.sim.faults import NO_FAULTS, FaultConfig
from gateway.sim.server import SimEngine
from gateway.testing.servers import sim_engines

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "kvgate-sim"
LONG = "A prompt long enough to fill a few blocks of the cache. " * 8


class Served:
    def __init__(self, cluster: SimCluster) -> None:
        self.cluster = cluster
        self.engine: SimEngine = cluster.engines[0]
        self.url = cluster.urls[0]
        self.http = httpx.AsyncClient(base_url=self.url, timeout=10)
        self.oai = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="-", max_retries=0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served() -> AsyncIterator[Served]:
    async with SimCluster(1, test_profile(), lora_modules=["sql-lora"]) as cluster:
        s = Served(cluster)
        try:
            yield s
        finally:
            await s.http.aclose()
            await s.oai.close()


# ---- cards, state, admin --------------------------------------------------------------------


async def test_models_list_the_base_and_its_lora_adapters(served: Served) -> None:
    listed = await served.oai.models.list()
    assert [m.id for m in listed.data] == [MODEL, "sql-lora"]
    lora = listed.data[1].model_dump()
    assert lora["parent"] == MODEL and lora["root"] == "sql-lora"
    assert lora["max_model_len"] is None
    card = (await served.http.get(f"/v1/models/{MODEL}")).json()
    assert card["max_model_len"] == 1024 and card["owned_by"] == "vllm"
    assert (await served.http.get("/v1/models/nope")).status_code == 404
    # An adapter's name is served (as the base model: the sim computes no adapter).
    answer = await served.oai.completions.create(model="sql-lora", prompt="x", max_tokens=2)
    assert answer.usage is not None and answer.usage.completion_tokens == 2


async def test_vllm_has_no_server_info_and_no_event_sources_without_events(
    served: Served,
) -> None:
    assert (await served.http.get("/server_info")).status_code == 404
    sources = await served.http.get("/kv_event_sources")
    assert sources.status_code == 200 and sources.json() == {}


async def test_state_and_faults_endpoints(served: Served) -> None:
    state = (await served.http.get("/sim/state")).json()
    assert state["role"] == "both" and state["profile"] == "test"
    assert state["engine_id"].startswith("kvgate-sim-0-")
    assert state["running"] == state["waiting"] == state["blocks_in_use"] == 0
    assert state["faults"] == NO_FAULTS.model_dump()
    set_ = await served.http.post("/admin/faults", json={"unhealthy": True})
    assert set_.json()["unhealthy"] is True
    assert (await served.http.get("/health")).status_code == 503
    assert (await served.http.get("/admin/faults")).json()["unhealthy"] is True
    cleared = await served.http.post("/admin/faults", content=b"")
    assert cleared.json() == NO_FAULTS.model_dump()
    assert (await served.http.get("/health")).status_code == 200
    for bad in (b'{"nope": 1}', b'{"error": 200}', b"[1]", b"{"):
        reply = await served.http.post("/admin/faults", content=bad)
        assert reply.status_code == 400, bad
        assert reply.json()["error"]["message"].startswith("invalid fault set")
    assert served.engine.faults.config == NO_FAULTS


async def test_reset_prefix_cache_when_idle_forgets_every_block(served: Served) -> None:
    body = chat_body(LONG, max_tokens=1)
    await served.http.post("/v1/chat/completions", json=body)
    assert (await served.http.get("/sim/state")).json()["cached_blocks"] > 0
    assert (await served.http.post("/reset_prefix_cache")).status_code == 200
    assert (await served.http.get("/sim/state")).json()["cached_blocks"] == 0
    again = (await served.http.post("/v1/chat/completions", json=body)).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_pd_endpoints_with_nothing_to_hand_over_are_404(served: Served) -> None:
    pulled = await served.http.get("/sim/kv/nobody")
    assert pulled.status_code == 404 and "no KV held" in pulled.json()["error"]["message"]
    room = await served.http.get("/sim/bootstrap/4242")
    assert room.status_code == 404 and "not ready" in room.json()["error"]["message"]
    # A room whose request finished without holding its KV is forgotten when asked for.
    served.engine.rooms[77] = "gone"
    assert (await served.http.get("/sim/bootstrap/77")).status_code == 404
    assert 77 not in served.engine.rooms


# ---- generation bodies ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "n": "one"}, "n"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "stream": True, "stream_options": [1]}, "stream_options"),
        ({"prompt": "x", "priority": "high"}, "priority"),
        ({"prompt": "x", "cache_salt": 5}, "cache_salt"),
        ({"prompt": "x", "kv_transfer_params": [1]}, "kv_transfer_params"),
        ({"prompt": "x", "bootstrap_room": 1, "bootstrap_host": 3}, "bootstrap_room"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "x", "model": 3}, "model"),
        ({"prompt": "x", "max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
async def test_bad_completion_bodies_are_400s_naming_the_field(
    served: Served, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await served.oai.post("/completions", body=body, cast_to=httpx.Response)
    error = bad.value.response.json()["error"]
    assert error["param"] == param and error["code"] == 400
    assert error["type"] == "BadRequestError"


async def test_a_body_that_is_not_an_object_and_a_prompt_too_long(served: Served) -> None:
    array = await served.http.post("/v1/completions", content=b"[1, 2]")
    assert array.status_code == 400 and "JSON object" in array.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as long:
        await served.oai.completions.create(model=MODEL, prompt="x" * 8000, max_tokens=1)
    assert "maximum context length is 1024 tokens" in str(long.value)
    rejected = served.engine.request_log[-1]
    assert rejected.status == 400 and rejected.output_tokens == 0
    with pytest.raises(openai.BadRequestError):
        await served.oai.completions.create(model=MODEL, prompt="x" * 40, max_tokens=1020)


async def test_token_id_prompts_count_one_token_an_id(served: Served) -> None:
    ids = list(range(1000, 1040))
    answer = await served.oai.completions.create(model=MODEL, prompt=ids, max_tokens=1)
    assert answer.usage is not None and answer.usage.prompt_tokens == 40
    single = await served.oai.completions.create(model=MODEL, prompt=["one"], max_tokens=1)
    assert single.usage is not None and single.usage.prompt_tokens == 1


async def test_the_first_budget_field_of_three_wins(served: Served) -> None:
    reply = await served.http.post(
        "/v1/chat/completions",
        json=chat_body("x", max_completion_tokens=2, max_tokens=9, ignore_eos=True),
    )
    assert reply.json()["usage"]["completion_tokens"] == 2


async def test_a_cache_salt_keeps_tenants_apart(served: Served) -> None:
    async def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        reply = await served.http.post(
            "/v1/chat/completions",
            json=chat_body("a tenant's own words " * 12, max_tokens=1, **extra),
        )
        return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert await cached("tenant-a") == 0
    assert await cached("tenant-b") == 0  # the same text, another tenant: no hit
    assert await cached("tenant-a") > 0
    assert await cached(None) == 0


async def test_the_request_id_comes_from_the_body_when_no_header_names_one(
    served: Served,
) -> None:
    reply = await served.http.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 1, "request_id": "body-7"}
    )
    assert reply.json()["id"] == "cmpl-body-7"
    assert "x-request-id" not in reply.headers
    assert served.engine.request_log[-1].request_id == "body-7"


async def test_continuous_usage_puts_running_counts_on_every_chunk(served: Served) -> None:
    body = chat_body(
        "count along",
        max_tokens=4,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    reply = await served.http.post("/v1/chat/completions", json=body)
    chunks = [
        orjson.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")
    ]
    counted = [c["usage"]["completion_tokens"] for c in chunks if c["choices"] and c["usage"]]
    assert counted == [1, 2, 3, 4]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


async def test_a_hard_prompt_fails_with_length_on_a_faulted_engine(served: Served) -> None:
    await served.cluster.set_faults(0, FaultConfig(hard_marker="PROVE"))
    try:
        hard = await served.oai.completions.create(
            model=MODEL, prompt="PROVE the theorem", max_tokens=200
        )
        easy = await served.oai.completions.create(model=MODEL, prompt="hello", max_tokens=200)
    finally:
        await served.cluster.set_faults(0, NO_FAULTS)
    assert hard.choices[0].finish_reason == "length"
    assert easy.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("path", "body", "marker"),
    [
        ("/v1/responses", {"input": "stall", "stream": True}, b"response.created"),
        (
            "/v1/messages",
            {"messages": [{"role": "user", "content": "stall"}], "max_tokens": 50, "stream": True},
            b"message_start",
        ),
    ],
)
async def test_a_stall_fault_stops_api_streams_mid_way(
    served: Served, path: str, body: dict[str, Any], marker: bytes
) -> None:
    await served.cluster.set_faults(0, FaultConfig(stall=2))
    received = b""
    try:
        async with served.http.stream("POST", path, json={"model": MODEL, **body}) as reply:
            pieces = reply.aiter_raw()
            async with asyncio.timeout(10):  # however slow the machine, two deltas come
                while received.count(b'"delta":') < 2:
                    received += await anext(pieces)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):  # then the stream stays open, silent
                    received += await anext(pieces)
    finally:
        await served.cluster.set_faults(0, NO_FAULTS)
    assert marker in received and received.count(b'"delta":') == 2
    assert served.engine.faults.stalled >= 1


# ---- middlewares --------------------------------------------------------------------------


async def test_every_request_is_recorded_and_its_id_echoed(served: Served) -> None:
    reply = await served.http.get("/health", headers={"X-Request-Id": "h-1", "X-Extra": "v"})
    assert reply.headers["x-request-id"] == "h-1"
    method, path, headers = served.engine.received[-1]
    assert (method, path) == ("GET", "/health")
    assert headers["x-extra"] == "v" and headers["x-request-id"] == "h-1"


async def test_an_api_key_guards_v1_and_admin_but_not_health_or_metrics() -> None:
    async with (
        SimCluster(1, test_profile(), api_key="sk-sim") as cluster,
        httpx.AsyncClient(base_url=cluster.urls[0]) as http,
    ):
        for path in ("/v1/models", "/admin/faults"):
            refused = await http.get(path)
            assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}
            wrong = await http.get(path, headers={"Authorization": "Bearer sk-other"})
            assert wrong.status_code == 401
            ok = await http.get(path, headers={"Authorization": "Bearer sk-sim"})
            assert ok.status_code == 200, path
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/metrics")).status_code == 200
        # What was refused still reached the engine, as a log of what arrived.
        assert cluster.engines[0].received[0][1] == "/v1/models"


# ---- an engine loop that dies ---------------------------------------------------------------


async def test_a_failed_engine_loop_fails_every_request_in_its_own_dialect() -> None:
    async with SimCluster(1, test_profile(decode_base_s=0.01)) as cluster:
        engine = cluster.engines[0]
        http = httpx.AsyncClient(base_url=engine.url, timeout=10)

        async def first_bytes(path: str, body: dict[str, Any]) -> tuple[Any, Any]:
            stream = http.stream("POST", path, json=body)
            reply = await stream.__aenter__()
            pieces = reply.aiter_raw()
            await anext(pieces)
            return stream, pieces

        opened = [
            await first_bytes("/v1/chat/completions", chat_body("a", max_tokens=500, stream=True)),
            await first_bytes("/v1/responses", {"input": "b", "stream": True}),
            await first_bytes(
                "/v1/messages",
                {"messages": [{"role": "user", "content": "c"}], "max_tokens": 500, "stream": True},
            ),
        ]
        buffered = asyncio.create_task(
            http.post("/v1/completions", json={"prompt": "d", "max_tokens": 500})
        )
        await eventually(lambda: engine.model.num_running == 4)

        def broken(now: float) -> float:
            raise RuntimeError("simulated GPU fault")

        engine.model.step = broken  # type: ignore[method-assign]
        await eventually(lambda: engine.runner.error is not None)
        tails = []
        for stream, pieces in opened:
            tails.append(b"".join([p async for p in pieces]))
            await stream.__aexit__(None, None, None)
        failed = await buffered
        assert (await http.get("/health")).status_code == 503
        refused = await http.post("/v1/completions", json={"prompt": "e", "max_tokens": 1})
        await http.aclose()
    chat, responses, messages = tails
    assert b'"code":500' in chat and chat.endswith(b"data: [DONE]\n\n")
    assert b"event: error" in responses and b"engine_stopped" in responses
    assert b"event: error" in messages and b"api_error" in messages
    assert failed.status_code == 500 and "engine loop failed" in failed.json()["error"]["message"]
    assert refused.status_code == 500


async def test_a_model_that_is_never_stepped_fails_its_waiters_cleanly() -> None:
    # The runner stops with requests in flight: they are aborted, their blocks freed.
    async with sim_engines(1) as (engine,):
        model: EngineModel = engine.model
        async with httpx.AsyncClient(base_url=engine.url, timeout=10) as http:
            running = asyncio.create_task(
                http.post("/v1/completions", json={"prompt": "x", "max_tokens": 900})
            )
            await eventually(lambda: model.num_running == 1)
            await engine.runner.stop()
            reply = await running
        assert model.kv.blocks_in_use == 0 and model.num_running == 0
        assert reply.json()["choices"][0]["finish_reason"] == "abort"
