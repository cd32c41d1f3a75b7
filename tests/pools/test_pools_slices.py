"""Growing-prefix slices of a prompt (gateway.pools.slices), pure."""

from __future__ import annotations

from typing import Any

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
