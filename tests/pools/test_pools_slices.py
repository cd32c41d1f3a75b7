"""Growing-prefix slices of a prompt (gateway.pools.slices), pure; and checked against what a
warm-up relies on, over random conversations: every slice is a prefix of the next and of the
request, the slices grow, the last is the request itself, parts that are not text are never cut."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from gateway.pools.slices import prefix_bodies


def text_of(body: dict[str, Any]) -> str:
    return "".join(m["content"] for m in body["messages"])


def test_off_short_or_unsliceable_prompts_are_one_request() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "x" * 4000}]}
    assert prefix_bodies(chat, 1000, 0) == [chat]
    assert prefix_bodies(chat, 200, 256) == [chat]
    batch = {"model": "m", "prompt": ["a" * 4000, "b" * 4000]}
    assert prefix_bodies(batch, 2000, 256) == [batch]


def test_chat_prefixes_grow_by_a_slice_and_end_with_the_request_itself() -> None:
    messages = [
        {"role": "system", "content": "s" * 2000},
        {"role": "user", "content": "u" * 3000},
        {"role": "assistant", "content": "a" * 1000},
        {"role": "user", "content": "q" * 2000},
    ]
    body = {"model": "m", "messages": messages, "max_tokens": 1}
    out = prefix_bodies(body, 2000, 256)  # 8,000 characters, about 1,024 per slice
    assert out[-1] is body
    texts = [text_of(b) for b in out]
    full = text_of(body)
    assert all(full.startswith(t) for t in texts)
    assert [len(t) for t in texts] == [1024, 2048, 3072, 4096, 5120, 6144, 7168, 8000]
    # Whole messages stay whole; only the message the cut falls in is shortened, and the
    # other fields ride along unchanged.
    third = out[2]
    assert third["messages"][0] is messages[0]
    assert third["messages"][1] == {"role": "user", "content": "u" * 1072}
    assert third["max_tokens"] == 1 and body["messages"] is messages


def test_chat_parts_are_never_cut() -> None:
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]}
    messages = [
        {"role": "system", "content": "s" * 3000},
        image,
        {"role": "user", "content": "q" * 3000},
    ]
    out = prefix_bodies({"messages": messages}, 1500, 256)
    for b in out[:-1]:
        for m in b["messages"]:
            assert m is image or isinstance(m["content"], str)
        assert all(
            m in messages or m["role"] != "user" or isinstance(m["content"], str)
            for m in b["messages"]
        )
    assert out[-1]["messages"] is messages


def test_completion_prompts_text_and_token_ids() -> None:
    text = {"prompt": "p" * 3000}
    assert [len(b["prompt"]) for b in prefix_bodies(text, 750, 256)] == [1024, 2048, 3000]
    ids = {"prompt": list(range(700))}
    assert [len(b["prompt"]) for b in prefix_bodies(ids, 700, 256)] == [256, 512, 700]
    # A last slice shorter than half a step is folded into the full request.
    assert [len(b["prompt"]) for b in prefix_bodies({"prompt": list(range(540))}, 540, 256)] == [
        256,
        540,
    ]


def is_prefix(short: list[Any], long: list[Any]) -> bool:
    """`short` is `long` cut somewhere: whole messages, then at most one cut text."""
    if not short or len(short) > len(long):
        return False
    *whole, last = short
    if whole != long[: len(whole)]:
        return False
    model = long[len(whole)]
    if last == model:
        return True
    return (
        isinstance(model.get("content"), str)
        and {k: v for k, v in last.items() if k != "content"}
        == {k: v for k, v in model.items() if k != "content"}
        and model["content"].startswith(last["content"])
    )


def chars(messages: list[Any]) -> int:
    return sum(len(m["content"]) if isinstance(m["content"], str) else 0 for m in messages)


def conversation(rng: random.Random) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(rng.randint(1, 7)):
        role = "user" if i % 2 == 0 else "assistant"
        if rng.random() < 0.2:
            content: Any = [
                {"type": "text", "text": "t" * rng.randint(0, 900)},
                {"type": "image_url", "image_url": {"url": "data:,"}},
            ]
        else:
            content = chr(97 + i) * rng.randint(0, 3000)
        out.append({"role": role, "content": content})
    return out


@pytest.mark.parametrize("seed", range(40))
def test_chat_slices_are_growing_prefixes_ending_with_the_request(seed: int) -> None:
    rng = random.Random(seed)
    messages = conversation(rng)
    body = {"model": "m", "messages": messages, "max_tokens": 1}
    slice_tokens = rng.choice([64, 256, 1000])
    prompt_tokens = rng.randint(1, 4000)
    out = prefix_bodies(body, prompt_tokens, slice_tokens)
    assert out[-1] is body
    for b in out:
        assert {k: v for k, v in b.items() if k != "messages"} == {"model": "m", "max_tokens": 1}
    for short, long in itertools.pairwise(out):
        assert is_prefix(short["messages"], long["messages"])
        assert short["messages"] != long["messages"]
    for b in out:
        assert is_prefix(b["messages"], messages)
        for m in b["messages"]:
            if isinstance(m["content"], list):  # parts are carried whole or not at all
                assert m in messages
    if prompt_tokens <= slice_tokens:
        assert out == [body]


def test_the_slices_step_is_about_slice_tokens_worth_of_characters() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 10_000}]}
    out = prefix_bodies(body, 2500, 250)  # 4 characters a token: 1,000 characters a slice
    lengths = [chars(b["messages"]) for b in out]
    assert lengths == [*range(1000, 10_000, 1000), 10_000]


def test_a_conversation_with_no_text_is_one_request() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": ""}, "not a message"]}
    assert prefix_bodies(body, 5000, 100) == [body]


def test_messages_that_are_not_objects_count_as_nothing_and_are_kept() -> None:
    messages: list[Any] = ["odd", {"role": "user", "content": "y" * 4000}]
    out = prefix_bodies({"model": "m", "messages": messages}, 1000, 250)
    assert len(out) > 2
    assert all(b["messages"][0] == "odd" for b in out)


@pytest.mark.parametrize("length", [1, 999, 1000, 1001, 4321])
def test_a_text_prompt_grows_to_itself(length: int) -> None:
    body = {"model": "m", "prompt": "p" * length}
    out = prefix_bodies(body, length // 4 + 1, 100)
    assert out[-1] is body
    sizes = [len(b["prompt"]) for b in out]
    assert sizes == sorted(set(sizes))
    assert all(body["prompt"].startswith(b["prompt"]) for b in out)
    assert all(b["prompt"] for b in out)


@pytest.mark.parametrize("n", [151, 1040, 1049, 1050, 1051, 1099])
def test_token_ids_are_cut_exactly_and_never_leave_a_sliver_at_the_end(n: int) -> None:
    ids = list(range(n))
    out = prefix_bodies({"model": "m", "prompt": ids}, n, 100)
    sizes = [len(b["prompt"]) for b in out]
    assert all(b["prompt"] == ids[: len(b["prompt"])] for b in out)
    assert sizes[:-1] == list(range(100, 100 * len(sizes), 100))
    assert sizes[-1] == n
    # The last slice is more than half a slice and at most one and a half.
    assert 50 < n - (sizes[-2] if len(sizes) > 1 else 0) <= 150


def test_an_empty_or_mixed_token_list_is_not_cut() -> None:
    for prompt in ([], [1, 2, "x"] * 500, [True] * 2000):
        body = {"model": "m", "prompt": prompt}
        assert prefix_bodies(body, 2000, 100) == [body]
