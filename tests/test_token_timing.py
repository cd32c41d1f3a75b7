"""gateway.token_timing: which SSE events carry a token, and the timing a stream gets."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest

from gateway.sim.profiles import PROFILES
from gateway.sim.server import SimEngine
from gateway.testing.clock import FakeClock
from gateway.token_timing import MAX_HELD_BYTES, StreamTimer, TokenEvents


def event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chat(delta: dict[str, object], **extra: object) -> bytes:
    return event(
        {
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
            **extra,
        }
    )


def completion(text: str) -> bytes:
    return event({"object": "text_completion", "choices": [{"index": 0, "text": text}]})


ROLE = chat({"role": "assistant", "content": ""})
USAGE = event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    ("data", "tokens"),
    [
        (ROLE, 0),
        (chat({"content": "Hi"}), 1),
        (chat({"content": None, "tool_calls": [{"index": 0, "function": {"name": "f"}}]}), 1),
        (chat({"reasoning_content": "hmm"}), 1),
        (chat({"reasoning": "hmm"}), 1),
        (chat({"content": ""}, usage=None), 0),
        (chat({"content": '"content":"x'}), 1),  # a quote inside content is escaped
        (chat({"content": "x"}, logprobs={"content": [{"token": "x"}]}), 1),
        (completion("block"), 1),
        (completion(""), 0),
        (USAGE, 0),
        (DONE, 0),
        (b": keep-alive\n\n", 0),
        (b'data: {"choices": [{"delta": {"content": "spaced"}}]}\n\n', 1),
        (b'data: {"choices":[{"delta":{"content":"crlf"}}]}\r\n\r\n', 1),
        (b'data: {"error": {"message": "engine died", "type": "server_error"}}\n\n', 0),
        (ROLE + chat({"content": "a"}) + chat({"content": "b"}) + USAGE + DONE, 2),
    ],
)
def test_token_events(data: bytes, tokens: int) -> None:
    assert TokenEvents().feed(data) == tokens


def test_events_split_anywhere_are_counted_once_when_complete() -> None:
    stream = ROLE + b"".join(chat({"content": f"t{i}"}) for i in range(5)) + USAGE + DONE
    counter = TokenEvents()
    per_byte = [counter.feed(stream[i : i + 1]) for i in range(len(stream))]
    assert sum(per_byte) == 5 and set(per_byte) == {0, 1}
    # A token counts at the byte that completes its event, not before.
    first_end = len(ROLE) + len(chat({"content": "t0"}))
    assert per_byte.index(1) == first_end - 1


def test_an_oversized_event_is_counted_once_and_not_held_whole() -> None:
    big = chat({"content": "x" * (3 * MAX_HELD_BYTES)})
    counter = TokenEvents()
    parts = [big[i : i + 4096] for i in range(0, len(big), 4096)]
    counts = [counter.feed(p) for p in parts]
    assert sum(counts) == 1 and len(counter._held) <= MAX_HELD_BYTES
    assert counter.feed(chat({"content": "next"})) == 1


def timer(clock: FakeClock) -> tuple[StreamTimer, dict[str, list[float]]]:
    seen: dict[str, list[float]] = {"ttft": [], "itl": [], "tpot": []}
    t = StreamTimer(clock(), seen["ttft"].append, seen["itl"].append, seen["tpot"].append, clock)
    return t, seen


def test_ttft_is_the_first_token_not_the_first_byte() -> None:
    clock = FakeClock()
    t, seen = timer(clock)
    clock.advance(0.1)
    t.feed(ROLE)  # first byte: no token yet
    clock.advance(0.4)
    t.feed(chat({"content": "a"}))
    for _ in range(3):
        clock.advance(0.05)
        t.feed(chat({"content": "b"}))
    clock.advance(0.1)
    t.feed(chat({"content": "c"}) + chat({"content": "d"}))  # two tokens in one read
    t.feed(USAGE + DONE)
    t.finish(completion_tokens=6)
    t.finish(completion_tokens=6)  # once only
    assert seen["ttft"] == [pytest.approx(0.5)] and t.ttft_s == pytest.approx(0.5)
    assert seen["itl"] == pytest.approx([0.05, 0.05, 0.05, 0.05, 0.05])
    assert seen["tpot"] == [pytest.approx(0.25 / 5)]
    assert t.token_events == 6


def test_tpot_falls_back_to_the_events_seen_and_needs_two_tokens() -> None:
    clock = FakeClock()
    t, seen = timer(clock)
    t.feed(chat({"content": "a"}))
    t.finish(None)
    assert seen["tpot"] == [] and len(seen["ttft"]) == 1
    t2, seen2 = timer(clock)
    t2.feed(chat({"content": "a"}))
    clock.advance(0.3)
    t2.feed(chat({"content": "b"}))
    clock.advance(0.3)
    t2.feed(chat({"content": "c"}))
    t2.finish(None)
    assert seen2["tpot"] == [pytest.approx(0.3)]


def test_a_stream_without_tokens_records_nothing() -> None:
    clock = FakeClock()
    t, seen = timer(clock)
    t.feed(ROLE + USAGE + DONE)
    t.finish(0)
    assert seen == {"ttft": [], "itl": [], "tpot": []} and t.ttft_s is None


# A profile whose timing is known: prefill at a fixed rate, then one token per fixed step.
PREFILL_TOKENS_PER_S = 800.0
DECODE_STEP_S = 0.04
FIXED = PROFILES["tiny"].scaled(
    name="fixed",
    prefill_tokens_per_s=PREFILL_TOKENS_PER_S,
    decode_base_s=DECODE_STEP_S,
    decode_per_seq_s=0.0,
    attention_s_per_token=0.0,
    step_overhead_s=0.0,
)


@pytest.mark.parametrize("kind", ["chat", "completions"])
async def test_timing_of_a_real_simulated_stream_follows_the_profile(
    kind: str,
) -> None:
    engine = SimEngine(FIXED, index=0)
    await engine.start()
    try:
        async with httpx.AsyncClient() as http:
            body: dict[str, object] = {
                "model": "kvgate-sim",
                "max_tokens": 16,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if kind == "chat":
                body["messages"] = [{"role": "user", "content": "word " * 300}]
                path = "/v1/chat/completions"
            else:
                body["prompt"] = "word " * 300
                path = "/v1/completions"
            seen: dict[str, list[float]] = {"ttft": [], "itl": [], "tpot": []}
            t0 = time.perf_counter()
            t = StreamTimer(t0, seen["ttft"].append, seen["itl"].append, seen["tpot"].append)
            raw = b""
            async with http.stream("POST", engine.url + path, json=body) as response:
                async for chunk in response.aiter_raw():
                    t.feed(chunk)
                    raw += chunk
            usage = orjson.loads(raw.split(b"\n\n")[-3][5:])["usage"]
            t.finish(usage["completion_tokens"])
    finally:
        await engine.stop()
    prefill_s = usage["prompt_tokens"] / PREFILL_TOKENS_PER_S
    # A sleep never ends early but overshoots on a busy host: the lower bounds are tight
    # (a timer counting two tokens per event halves the gaps), the upper ones loose (one
    # counting every other event doubles them).
    itl = sum(seen["itl"]) / len(seen["itl"])
    for measured, expected in ((seen["ttft"][0], prefill_s), (seen["tpot"][0], DECODE_STEP_S)):
        assert 0.9 * expected <= measured <= 1.5 * expected
    assert 0.9 * DECODE_STEP_S <= itl <= 1.5 * DECODE_STEP_S
    assert t.token_events == usage["completion_tokens"] == 16


def test_responses_and_anthropic_deltas_are_tokens() -> None:
    responses = (
        b'event: response.created\ndata: {"type":"response.created","response":{"output":[]}}\n\n'
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"a"}\n\n'
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":" b"}\n\n'
    )
    anthropic = (
        b'event: message_start\ndata: {"type":"message_start","message":{"content":[]}}\n\n'
        b'event: content_block_start\ndata: {"content_block":{"type":"text","text":""}}\n\n'
        b'event: content_block_delta\ndata: {"delta":{"type":"text_delta","text":"a"}}\n\n'
    )
    assert TokenEvents().feed(responses) == 2
    assert TokenEvents().feed(anthropic) == 1


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"mixed"])
def test_several_events_in_one_read_count_alike_with_either_line_ending(newline: bytes) -> None:
    # A read holding many events (a fast engine, or a relay that fell behind) splits them
    # without a regex when no "\r" is in it; the count must not depend on that.
    events = [
        chat({"role": "assistant", "content": ""}),
        chat({"content": "a"}),
        b": keep-alive\n\n",
        chat({"reasoning_content": "b"}),
        chat({"content": None}),
        chat({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}),
        b"data: [DONE]\n\n",
    ]
    if newline == b"\r\n":
        events = [e.replace(b"\n", b"\r\n") for e in events]
    elif newline == b"mixed":
        events = [e.replace(b"\n", b"\r\n") if i % 2 else e for i, e in enumerate(events)]
    data = b"".join(events)
    assert TokenEvents().feed(data) == 3
    # The same bytes in two reads, the first ending inside an event, count the same.
    counter = TokenEvents()
    assert counter.feed(data[:150]) + counter.feed(data[150:]) == 3
