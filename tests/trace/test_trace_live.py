"""The gateway capturing its own traffic: through real servers, and the writer's limits."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from pydantic import ValidationError

from gateway.errors import ConfigError
from gateway.hooks import RequestOutcome
from gateway.testing.servers import gateway, sim_engines
from gateway.trace.capture import salt_id
from gateway.trace.config import TraceCaptureSettings
from gateway.trace.format import read_trace
from gateway.trace.live import GatewayCapture
from gateway.trace.stats import compute_stats, render_stats
from gateway.types import ReplicaId, RouteRequest, SessionKey

MODEL = "kvgate-sim"
SYSTEM = "".join(f"Rule {i}: the Quillfeather archive opens at dawn only. " for i in range(40))
SALT = b"live-capture-test-salt-0123456789"


async def test_gateway_writes_a_private_trace(tmp_path: Path) -> None:
    path, salt_file = tmp_path / "live.jsonl", tmp_path / "salt"
    capture = {"enabled": True, "path": str(path), "salt_file": str(salt_file)}
    first = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Where is Perpetua?"},
    ]
    second = first + [
        {"role": "assistant", "content": "In the archive."},
        {"role": "user", "content": "Since when?"},
    ]
    async with sim_engines(2, "instant") as engines, gateway(engines, trace_capture=capture) as gw:
        assert gw.state.extras["trace_capture"] is not None
        async with openai.AsyncOpenAI(
            base_url=gw.url + "/v1", api_key="k", max_retries=0
        ) as client:
            headers = {"X-Session-Id": "secret-session-42"}
            a = await client.chat.completions.create(
                model=MODEL, messages=first, max_tokens=5, extra_headers=headers
            )  # type: ignore[arg-type]
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=second,
                max_tokens=7,
                stream=True,  # type: ignore[arg-type]
                stream_options={"include_usage": True},
                extra_headers=headers,
            )
            async for _ in stream:
                pass
            await client.embeddings.create(model=MODEL, input=["not captured"])
    assert a.usage is not None
    # The gateway has stopped: its lifespan drained and closed the writer.
    trace = read_trace(path)
    assert trace.header.source == "gateway"
    assert trace.header.salt_id == salt_id(salt_file.read_bytes().strip())
    assert trace.header.block_tokens == 64
    assert len(trace.records) == 2
    r1, r2 = trace.records
    assert (r1.output_tokens, r2.output_tokens) == (5, 7)
    assert r1.input_tokens == a.usage.prompt_tokens
    assert r1.session_id == r2.session_id and r1.session_id != "secret-session-42"
    # The shared system prompt (~500 tokens) gives several equal leading 64-token blocks.
    shared = 0
    while r1.block_hashes[shared] == r2.block_hashes[shared]:
        shared += 1
    assert shared >= 6
    data = path.read_bytes().lower()
    for needle in ("quillfeather", "archive", "perpetua", "secret-session", "since when"):
        assert needle.encode() not in data


def outcome(i: int) -> RequestOutcome:
    request = RouteRequest(
        request_id=f"r{i}",
        model=MODEL,
        session_key=SessionKey(f"s{i}"),
        prefix_hashes=(11, 12, 13, 14),
        block_tokens=16,
        prompt_tokens=70,
    )
    return RequestOutcome(
        request=request,
        request_id=f"r{i}",
        endpoint="chat",
        replica=ReplicaId("e0"),
        status=200,
        ok=True,
        stream=False,
        prompt_tokens=70,
        completion_tokens=3,
        started_at=1_700_000_000.0 + i,
    )


async def test_full_queue_drops_and_counts_instead_of_waiting(tmp_path: Path) -> None:
    settings = TraceCaptureSettings(enabled=True, path=str(tmp_path / "t.jsonl"), queue_size=2)
    capture = GatewayCapture(settings, SALT)
    for i in range(5):  # writer not started yet: nothing drains the queue
        capture.observe(outcome(i))
    assert capture.dropped == 3
    await capture.start()
    await capture.stop()
    assert capture.captured == 2
    trace = read_trace(tmp_path / "t.jsonl")
    assert len(trace.records) == 2
    rec = trace.records[0]
    # 4 gateway blocks of 16 = one 64-token block, plus 6 tail tokens in a block of their own.
    assert rec.input_tokens == 70 and len(rec.block_hashes) == 2 and rec.last_block_tokens == 6
    assert trace.records[1].block_hashes[0] == rec.block_hashes[0]
    assert trace.records[1].block_hashes[1] != rec.block_hashes[1]


async def test_appends_across_restarts_and_refuses_another_salt(tmp_path: Path) -> None:
    settings = TraceCaptureSettings(enabled=True, path=str(tmp_path / "t.jsonl"))
    for round_ in range(2):
        capture = GatewayCapture(settings, SALT)
        await capture.start()
        capture.observe(outcome(round_))
        await capture.stop()
    trace = read_trace(tmp_path / "t.jsonl")
    assert len(trace.records) == 2
    assert (tmp_path / "t.jsonl").read_bytes().count(b"kvgate_trace") == 1
    other = GatewayCapture(settings, b"another-salt-of-enough-length")
    with pytest.raises(ConfigError, match="salt id"):
        await other.start()


def test_settings_need_a_path_when_enabled() -> None:
    with pytest.raises(ValidationError):
        TraceCaptureSettings(enabled=True)
    assert TraceCaptureSettings().enabled is False


async def test_messages_and_responses_are_captured_with_their_usage(tmp_path: Path) -> None:
    import anthropic
    import httpx

    path = tmp_path / "live.jsonl"
    capture = {"enabled": True, "path": str(path), "salt_file": str(tmp_path / "salt")}
    async with sim_engines(2, "instant") as engines, gateway(engines, trace_capture=capture) as gw:
        async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="k", max_retries=0) as claude:
            stream = claude.messages.stream(
                model=MODEL,
                max_tokens=3,
                system=SYSTEM,
                messages=[{"role": "user", "content": "hi"}],
            )
            async with stream as events:
                message = await events.get_final_message()
        async with openai.AsyncOpenAI(
            base_url=gw.url + "/v1", api_key="k", max_retries=0
        ) as client:
            response = await client.responses.create(
                model=MODEL, input="hello", max_output_tokens=4
            )
        async with httpx.AsyncClient(base_url=gw.url) as http:
            tokens = await http.post("/tokenize", json={"model": MODEL, "prompt": "not captured"})
            assert tokens.status_code == 200
    records = read_trace(path).records
    assert [r.output_tokens for r in records] == [3, 4]
    usage = message.usage
    assert records[0].input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)
    assert response.usage is not None and records[1].input_tokens == response.usage.input_tokens


async def test_the_capture_records_predicted_best_and_reported_cache_hits(
    tmp_path: Path,
) -> None:
    path = tmp_path / "live.jsonl"
    capture = {"enabled": True, "path": str(path), "salt_file": str(tmp_path / "salt")}
    messages: list[dict[str, str]] = [
        {"role": "system", "content": SYSTEM * 4},
        {"role": "user", "content": "Where is Perpetua?"},
    ]
    reported: list[int] = []
    async with (
        sim_engines(2, "instant") as engines,
        gateway(engines, trace_capture=capture) as gw,
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client,
    ):
        for turn in range(3):
            answer = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=3
            )  # type: ignore[arg-type]
            assert answer.usage is not None and answer.usage.prompt_tokens_details
            reported.append(answer.usage.prompt_tokens_details.cached_tokens or 0)
            messages += [
                {"role": "assistant", "content": answer.choices[0].message.content or ""},
                {"role": "user", "content": f"and then ({turn})?"},
            ]
    records = read_trace(path).records
    assert [r.achieved_cached for r in records] == reported
    assert reported[-1] > 0
    for r in records:
        assert r.predicted_cached is not None and r.best_cached is not None
        assert r.best_cached >= r.predicted_cached
    assert records[0].predicted_cached == 0 and records[-1].predicted_cached > 0
    stats = compute_stats(read_trace(path))
    assert stats.forecast is not None and stats.forecast.requests == 3
    assert stats.forecast.achieved == sum(reported)
    assert "cache forecast   3 requests as routed" in render_stats(stats)
    assert stats.as_dict()["cache_forecast"]["achieved_tokens"] == sum(reported)
