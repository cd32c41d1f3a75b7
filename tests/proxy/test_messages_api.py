"""Anthropic's /v1/messages through the official `anthropic` client: answers, streams,
errors in Anthropic's shape (the gateway's own and the engine's), and an agent-style client
whose own session header keeps each of its conversations on one replica."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anthropic
import httpx
import pytest

from gateway.auth.principal import hash_key
from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway, gateway

MODEL = "kvgate-sim"


@pytest.fixture
async def client(gw: RunningGateway) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="k", max_retries=0) as client:
        yield client


def user(text: str) -> list[anthropic.types.MessageParam]:
    return [{"role": "user", "content": text}]


async def test_message_non_streaming(client: anthropic.AsyncAnthropic) -> None:
    raw = await client.messages.with_raw_response.create(
        model=MODEL, max_tokens=5, system="be brief", messages=user("hello")
    )
    message = await raw.parse()
    assert message.type == "message" and message.role == "assistant"
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 5
    block = message.content[0]
    assert block.type == "text" and len(block.text.split()) == 5
    assert raw.headers["x-kvgate-replica"] in {"e0", "e1", "e2"}


async def test_message_streaming(client: anthropic.AsyncAnthropic) -> None:
    async with client.messages.stream(model=MODEL, max_tokens=4, messages=user("stream")) as stream:
        pieces = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert len(pieces) == 4
    block = final.content[0]
    assert block.type == "text" and block.text == "".join(pieces)
    assert final.usage.output_tokens == 4 and final.stop_reason == "max_tokens"


async def test_errors_are_in_anthropics_shape(
    client: anthropic.AsyncAnthropic, gw: RunningGateway
) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client.messages.create(model="no-such-model", max_tokens=4, messages=user("hi"))
    assert missing.value.body == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": "The model `no-such-model` does not exist.",
        },
    }
    with pytest.raises(anthropic.BadRequestError) as empty:
        await client.messages.create(model=MODEL, max_tokens=4, messages=[])
    assert (
        isinstance(empty.value.body, dict)
        and empty.value.body["error"]["type"] == "invalid_request_error"
    )
    async with httpx.AsyncClient(base_url=gw.url) as http:
        no_max = await http.post("/v1/messages", json={"model": MODEL, "messages": user("hi")})
        bad_json = await http.post(
            "/v1/messages", content=b"{", headers={"content-type": "application/json"}
        )
    for r in (no_max, bad_json):
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in no_max.json()["error"]["message"]


async def test_auth_refusal_is_in_anthropics_shape(engines: list[SimEngine]) -> None:
    auth = {"keys": [{"name": "alice", "key_sha256": hash_key("sk-alice-0123456789")}]}
    async with gateway(engines, auth=auth) as gw:
        async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="wrong", max_retries=0) as bad:
            with pytest.raises(anthropic.AuthenticationError) as info:
                await bad.messages.create(model=MODEL, max_tokens=2, messages=user("hi"))
        assert (
            isinstance(info.value.body, dict)
            and info.value.body["error"]["type"] == "authentication_error"
        )
        # The anthropic client sends its key as x-api-key, which the gateway accepts.
        async with anthropic.AsyncAnthropic(
            base_url=gw.url, api_key="sk-alice-0123456789", max_retries=0
        ) as ok:
            message = await ok.messages.create(model=MODEL, max_tokens=2, messages=user("hi"))
        assert message.usage.output_tokens == 2


async def _agent_sessions(gw: RunningGateway, header: str | None) -> dict[int, set[str]]:
    """Eight sessions of an agent that rewrites its context every turn (a compaction, a
    sub-task with fresh notes): no prompt prefix ties a session's turns together, only the
    session id the agent sends on its own."""
    by_session: dict[int, set[str]] = {}
    for session in range(8):
        async with anthropic.AsyncAnthropic(
            base_url=gw.url,
            api_key="k",
            max_retries=0,
            default_headers={header: f"9f1c-session-{session}"} if header else None,
        ) as client:
            for turn in range(3):
                summary = f"summary {turn} of session {session}: " + "notes " * 200
                raw = await client.messages.with_raw_response.create(
                    model=MODEL,
                    max_tokens=2,
                    system=f"agent, step {turn}",
                    messages=user(summary),
                )
                by_session.setdefault(session, set()).add(raw.headers["x-kvgate-replica"])
    return by_session


async def test_claude_code_session_header_keeps_each_session_on_one_replica(
    gw: RunningGateway,
) -> None:
    with_header = await _agent_sessions(gw, "X-Claude-Code-Session-Id")
    assert all(len(r) == 1 for r in with_header.values()), with_header
    assert len(set().union(*with_header.values())) >= 2, with_header
    # Without it nothing ties a session's turns together: they scatter.
    without = await _agent_sessions(gw, None)
    assert any(len(r) > 1 for r in without.values()), without


async def test_opencode_session_header_counts_too(gw: RunningGateway) -> None:
    assert all(len(r) == 1 for r in (await _agent_sessions(gw, "x-opencode-session")).values())


async def test_count_tokens_is_the_prompt_a_message_would_have(
    client: anthropic.AsyncAnthropic, engines: list[SimEngine]
) -> None:
    messages = user("count the tokens of this conversation, please " * 20)
    raw = await client.messages.with_raw_response.count_tokens(
        model=MODEL, system="be brief", messages=messages
    )
    counted = await raw.parse()
    assert counted.input_tokens > 100
    assert raw.headers["x-kvgate-replica"] in {"e0", "e1", "e2"}
    # Answered by the engine (its tokenizer and template), and equal to what it then charges.
    assert [r.prompt_tokens for e in engines for r in e.request_log if r.endpoint == "count_tokens"]
    message = await client.messages.create(
        model=MODEL, max_tokens=1, system="be brief", messages=messages
    )
    used = message.usage
    assert used.input_tokens + (used.cache_read_input_tokens or 0) == counted.input_tokens


async def test_count_tokens_errors_are_in_anthropics_shape(
    client: anthropic.AsyncAnthropic,
) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client.messages.count_tokens(model="no-such-model", messages=user("hi"))
    assert isinstance(missing.value.body, dict)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        await client.messages.count_tokens(model=MODEL, messages=[])
    assert isinstance(bad.value.body, dict) and bad.value.body["type"] == "error"
