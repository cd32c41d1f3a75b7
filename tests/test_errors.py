"""The error tree's renderers: one error, told in each dialect a route speaks."""

from __future__ import annotations

import asyncio
import math

import httpx
import openai
import orjson
import pytest

from gateway.errors import (
    BadRequest,
    GatewayError,
    InvalidJSON,
    ModelNotFound,
    NoHealthyReplica,
    PayloadTooLarge,
    RateLimited,
    UpstreamStalled,
    UpstreamStatusError,
    anthropic_body,
    error_response_parts,
    stream_error_event,
)
from gateway.health import Health
from gateway.sim.faults import FaultConfig
from gateway.testing.servers import gateway, sim_engines
from gateway.types import ReplicaId

ANTHROPIC_KINDS = {
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "overloaded_error",
    "timeout_error",
}


def _data(event: bytes) -> dict[str, object]:
    lines = event.decode().split("\n")
    assert event.endswith(b"\n\n")
    payload = [ln.removeprefix("data: ") for ln in lines if ln.startswith("data: ")]
    assert len(payload) == 1
    parsed: dict[str, object] = orjson.loads(payload[0])
    return parsed


def test_openai_stream_event_carries_the_same_object_as_the_json_body() -> None:
    err = BadRequest("bad field", param="messages")
    event = stream_error_event(err)
    assert event.startswith(b"data: ")
    assert _data(event) == orjson.loads(err.body())


@pytest.mark.parametrize(
    ("last", "expected"),
    [
        (b"", 0),
        (b'event: response.output_text.delta\ndata: {"sequence_number": 6}\n\n', 7),
        (b'data: {"sequence_number":1}\n\ndata: {"sequence_number": 41}\n\n', 42),
    ],
)
def test_responses_error_event_is_numbered_after_the_last_event(last: bytes, expected: int) -> None:
    err = UpstreamStalled("replica r0 stalled")
    event = stream_error_event(err, "responses", last)
    assert event.startswith(b"event: error\n")
    data = _data(event)
    assert data["type"] == "error" and data["sequence_number"] == expected
    assert data["message"] == err.message
    # No code on the class: the type stands in for it, never null.
    assert data["code"] == (err.code or err.error_type) and data["code"]


@pytest.mark.parametrize("err", [PayloadTooLarge("big"), RateLimited("slow"), GatewayError("x")])
def test_anthropic_shape_on_the_stream_and_in_the_body_agree(err: GatewayError) -> None:
    event = stream_error_event(err, "anthropic")
    assert event.startswith(b"event: error\n")
    assert _data(event) == orjson.loads(anthropic_body(err))
    body = orjson.loads(anthropic_body(err))
    assert body["type"] == "error" and body["error"]["message"] == err.message
    # The Messages API's own kinds, never OpenAI's type names ("server_error").
    assert body["error"]["type"] in ANTHROPIC_KINDS


@pytest.mark.parametrize("shape", ["openai", "anthropic"])
def test_response_parts_are_consistent_http(shape: str) -> None:
    err = NoHealthyReplica("none", retry_after_s=3)
    status, headers, body = error_response_parts(err, shape)  # type: ignore[arg-type]
    assert status == 503
    named = dict(headers)
    assert int(named[b"content-length"]) == len(body)
    assert named[b"content-type"] == b"application/json"
    assert named[b"retry-after"] == b"3"
    assert all(k == k.lower() for k, _ in headers)
    orjson.loads(body)


@pytest.mark.parametrize("wait", [0.0, 0.0004, 0.2, 1.0, 2.5, 7.9])
def test_rate_limited_never_asks_for_less_than_the_wait(wait: float) -> None:
    headers = RateLimited("slow", retry_after_s=wait).headers
    seconds = int(headers["retry-after"])
    assert seconds >= 1 and seconds >= math.ceil(wait - 1e-9)
    assert int(headers["retry-after-ms"]) == int(wait * 1000)


# -- the one boundary: each error a live gateway answers, as the official client sees it ---

CHAT = "/v1/chat/completions"
RIDS = (ReplicaId("e0"), ReplicaId("e1"))


def _chat(content: str = "hi", model: str = "kvgate-sim") -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1}


def _assert_rendered(r: httpx.Response, err: type[GatewayError]) -> dict[str, object]:
    """`r` is `err` as `error_response_parts` renders it: its status, a JSON body holding
    OpenAI's error object with exactly its four fields, the class's type and code."""
    assert r.status_code == err.status, r.text
    assert r.headers["content-type"] == "application/json"
    assert int(r.headers["content-length"]) == len(r.content)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == (err.error_type, err.code)
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


async def test_request_errors_are_rendered_by_their_class() -> None:
    async with (
        sim_engines(1, "instant") as engines,
        gateway(engines, limits={"max_body_bytes": 4096}) as gw,
        httpx.AsyncClient(base_url=gw.url) as client,
    ):
        json_headers = {"content-type": "application/json"}
        r = await client.post(CHAT, content=b"{not json", headers=json_headers)
        _assert_rendered(r, InvalidJSON)
        r = await client.post(CHAT, content=b"[1, 2]", headers=json_headers)
        _assert_rendered(r, InvalidJSON)
        r = await client.post(CHAT, content=b"{}" + b" " * 8192, headers=json_headers)
        _assert_rendered(r, PayloadTooLarge)
        r = await client.post(CHAT, json=_chat(model="no-such-model"))
        assert _assert_rendered(r, ModelNotFound)["param"] == "model"
        # The gateway still serves after each of them.
        assert (await client.post(CHAT, json=_chat())).status_code == 200

        sdk = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        try:
            with pytest.raises(openai.NotFoundError) as caught:
                await sdk.chat.completions.create(
                    model="no-such-model",
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=1,
                )
            assert caught.value.code == ModelNotFound.code
            assert caught.value.param == "model"
        finally:
            await sdk.close()


async def test_upstream_failures_are_rendered_by_their_class() -> None:
    async with sim_engines(2, "instant") as engines:
        retries = {"max_attempts": 2}
        probes = {"interval_s": 0.05, "idle_interval_s": 0.05, "failure_threshold": 1}
        async with (
            gateway(engines, retries=retries, health=probes) as gw,
            httpx.AsyncClient(base_url=gw.url) as client,
        ):
            for engine in engines:
                await engine.set_faults(FaultConfig(error=503))
            r = await client.post(CHAT, json=_chat())
            error = _assert_rendered(r, UpstreamStatusError)
            # Names a replica by its id, never the engine's address.
            assert "replica e" in str(error["message"])
            assert str(engines[0].port) not in str(error["message"])
            assert [gw.state.cluster.in_flight[r] for r in RIDS] == [0, 0]

            for engine in engines:
                await engine.set_faults(FaultConfig(unhealthy=True))
            health = gw.state.health
            for _ in range(400):  # the probes (every 50 ms) eject both
                if all(health.state(r) is Health.EJECTED for r in RIDS):
                    break
                await asyncio.sleep(0.01)
            r = await client.post(CHAT, json=_chat())
            _assert_rendered(r, NoHealthyReplica)
            assert int(r.headers["retry-after"]) >= 1
