"""The usage-only SSE event filter and the body injection, without servers."""

from __future__ import annotations

import random

import orjson

from gateway.stream_usage import MAX_HELD_BYTES, UsageStripper, inject_usage, with_usage_option


def event(obj: object, sep: bytes = b"\n\n") -> bytes:
    return b"data: " + orjson.dumps(obj) + sep


USAGE = {
    "prompt_tokens": 1540,
    "completion_tokens": 3,
    "total_tokens": 1543,
    "prompt_tokens_details": {"cached_tokens": 1536},
}
TOKENS = [
    event({"id": "c", "choices": [{"index": 0, "delta": {"content": t}}], "usage": None})
    for t in ("Hel", 'lo "usage":{ \n\n', "!")
]
USAGE_EVENT = event({"id": "c", "choices": [], "usage": USAGE})
DONE = b"data: [DONE]\n\n"
STREAM = b"".join(TOKENS) + USAGE_EVENT + DONE
EXPECTED = b"".join(TOKENS) + DONE


def run(chunks: list[bytes]) -> tuple[list[bytes], UsageStripper]:
    stripper = UsageStripper()
    out = [stripper.feed(c) for c in chunks]
    out.append(stripper.flush())
    return out, stripper


def split(data: bytes, rng: random.Random) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(data)), rng.randint(1, 12)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


def test_usage_event_removed_across_arbitrary_chunk_boundaries() -> None:
    rng = random.Random(7)
    splittings = [[STREAM], [bytes([b]) for b in STREAM]] + [split(STREAM, rng) for _ in range(300)]
    for chunks in splittings:
        out, stripper = run(chunks)
        assert b"".join(out) == EXPECTED
        assert stripper.usage == USAGE


def test_complete_events_are_never_held() -> None:
    # Every chunk that ends on an event boundary comes out whole at once.
    stripper = UsageStripper()
    for chunk in [TOKENS[0] + TOKENS[1], TOKENS[2], USAGE_EVENT, DONE]:
        assert stripper.feed(chunk) == (b"" if chunk == USAGE_EVENT else chunk)
    # A partial event is held until its end arrives, and only the partial part.
    stripper = UsageStripper()
    assert stripper.feed(TOKENS[0] + TOKENS[2][:7]) == TOKENS[0]
    assert stripper.feed(TOKENS[2][7:]) == TOKENS[2]


def test_after_the_usage_event_chunks_pass_untouched() -> None:
    stripper = UsageStripper()
    assert stripper.feed(USAGE_EVENT + DONE[:4]) == DONE[:4]
    assert stripper.feed(DONE[4:]) == DONE[4:]
    assert stripper.flush() == b""


def test_crlf_boundaries_and_usage_in_choice_chunks_kept() -> None:
    crlf = [
        event({"choices": [{"delta": {}}], "usage": None}, b"\r\n\r\n"),
        event({"choices": [], "usage": USAGE}, b"\r\n\r\n"),
        b"data: [DONE]\r\n\r\n",
    ]
    out, stripper = run(split(b"".join(crlf), random.Random(1)))
    assert b"".join(out) == crlf[0] + crlf[2] and stripper.usage == USAGE
    # Usage on a chunk that has choices (continuous stats) is not the usage-only event.
    with_choices = event({"choices": [{"delta": {"content": "x"}}], "usage": USAGE})
    out, stripper = run([with_choices, DONE])
    assert b"".join(out) == with_choices + DONE and stripper.usage is None


def test_stream_without_usage_and_truncated_stream_pass_through() -> None:
    plain = b"".join(TOKENS) + DONE
    out, stripper = run(split(plain, random.Random(3)))
    assert b"".join(out) == plain and stripper.usage is None
    # A stream cut mid-event: the fragment still reaches the client at the end.
    cut = STREAM[: len(b"".join(TOKENS)) + 20]
    out, stripper = run([cut])
    assert b"".join(out) == cut and out[-1] == USAGE_EVENT[:20]


def test_oversized_event_is_not_held() -> None:
    big = event({"choices": [{"delta": {"content": "x" * (2 * MAX_HELD_BYTES)}}], "usage": None})
    stripper = UsageStripper()
    first = stripper.feed(big[: MAX_HELD_BYTES + 10])
    assert first == big[: MAX_HELD_BYTES + 10]
    assert stripper.feed(big[MAX_HELD_BYTES + 10 :] + USAGE_EVENT[:5]) == big[MAX_HELD_BYTES + 10 :]
    assert stripper.feed(USAGE_EVENT[5:] + DONE) == DONE
    assert stripper.usage == USAGE


def test_inject_usage() -> None:
    body = {"model": "m", "stream": True}
    assert inject_usage(body) == ({**body, "stream_options": {"include_usage": True}}, True)
    assert body == {"model": "m", "stream": True}  # the caller's body is not mutated
    off = {**body, "stream_options": {"include_usage": False}}
    assert inject_usage(off) == ({**body, "stream_options": {"include_usage": True}}, True)
    continuous = {**body, "stream_options": {"continuous_usage_stats": True}}
    injected = inject_usage(continuous)
    assert injected is not None and injected[1] is False
    assert injected[0]["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    assert inject_usage({**body, "stream_options": {"include_usage": True}}) is None
    assert inject_usage({**body, "stream_options": "yes"}) is None
    assert (
        inject_usage({"model": "m"}) is None
        and inject_usage({"model": "m", "stream": False}) is None
    )


def test_usage_option_is_spliced_into_the_clients_bytes() -> None:
    """No re-serialisation of the body: its bytes with the field in front, the same JSON."""
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x" * 5000}]}
    for raw in (
        orjson.dumps(body),
        b'  \n{ "model" : "m", "stream": true, "messages": '
        + orjson.dumps(body["messages"])
        + b"}",
    ):
        spliced = with_usage_option(body, raw)
        assert spliced is not None and spliced.endswith(raw[-100:])
        injected = inject_usage(body)
        assert injected is not None and orjson.loads(spliced) == injected[0]
    # Where a field of that name exists (even null), splicing would leave two: not done.
    assert with_usage_option({**body, "stream_options": None}, b'{"stream_options":null}') is None
    assert with_usage_option(body, b"[1]") is None and with_usage_option({}, b"{}") is None
