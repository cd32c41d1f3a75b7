from __future__ import annotations

from typing import Any

from gateway.keys import route_request, session_key
from gateway.types import Endpoint

SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 20}


def chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages), **extra}


def key(
    body: dict[str, Any], endpoint: Endpoint = Endpoint.CHAT, header: str | None = None
) -> tuple[str, str]:
    return session_key(body, endpoint, header)


def test_precedence_header_then_cache_key_then_user_then_conversation() -> None:
    body = chat(SYSTEM, {"role": "user", "content": "hi"}, prompt_cache_key="pck", user="u1")
    assert key(body, header="sess")[1] == "header"
    assert key(body)[1] == "prompt_cache_key"
    del body["prompt_cache_key"]
    # `user` names a session only when the operator says so.
    assert key(body)[1] == "conversation"
    assert session_key(body, Endpoint.CHAT, None, user_is_session=True)[1] == "user"
    del body["user"]
    assert key(body)[1] == "conversation"


def test_sources_do_not_collide_and_values_are_hashed() -> None:
    body = chat({"role": "user", "content": "x"})
    h, _ = key(body, header="abc")
    p, _ = key({**body, "prompt_cache_key": "abc"})
    u, _ = key({**body, "user": "abc"})
    assert len({h, p, u}) == 3
    assert "abc" not in h + p + u


def test_later_turns_keep_the_conversation_key() -> None:
    turn1 = chat(SYSTEM, {"role": "user", "content": "plan a trip to Lyon"})
    turn2 = chat(
        SYSTEM,
        {"role": "user", "content": "plan a trip to Lyon"},
        {"role": "assistant", "content": "Day 1: ..."},
        {"role": "user", "content": "and day 2?"},
    )
    turn3 = chat(
        *turn2["messages"],
        {"role": "assistant", "content": "Day 2"},
        {"role": "user", "content": "thanks"},
    )
    assert key(turn1) == key(turn2) == key(turn3)


def test_conversations_sharing_only_the_system_prompt_differ() -> None:
    a = chat(SYSTEM, {"role": "user", "content": "question A"})
    b = chat(SYSTEM, {"role": "user", "content": "question B"})
    assert key(a)[0] != key(b)[0]


def test_model_is_part_of_the_conversation_key() -> None:
    a = chat({"role": "user", "content": "q"})
    assert key(a)[0] != key({**a, "model": "other"})[0]


def test_content_parts_and_tool_calls_are_hashed() -> None:
    a = chat(
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "hi"},
                {"type": "image_url", "image_url": {"url": "x"}},
            ],
        }
    )
    b = chat(
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "hi"},
                {"type": "image_url", "image_url": {"url": "y"}},
            ],
        }
    )
    assert key(a)[0] != key(b)[0]
    tools = chat({"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]})
    assert key(tools)[1] == "conversation"


def test_completions_key_on_leading_characters() -> None:
    base = "p" * 2000
    a = {"model": "m", "prompt": base}
    b = {"model": "m", "prompt": base + " more turns"}
    c = {"model": "m", "prompt": "q" + base}
    assert key(a, Endpoint.COMPLETIONS) == key(b, Endpoint.COMPLETIONS)
    assert key(a, Endpoint.COMPLETIONS) != key(c, Endpoint.COMPLETIONS)
    tokens = {"model": "m", "prompt": [1, 2, 3]}
    assert key(tokens, Endpoint.COMPLETIONS)[1] == "conversation"


def test_route_request_fields() -> None:
    body = chat(SYSTEM, {"role": "user", "content": "x" * 4000}, max_tokens=7, stream=True)
    req = route_request(
        body,
        Endpoint.CHAT,
        "rid",
        block_tokens=16,
        max_prefix_blocks=8,
        tenant="t",
        priority_class="hi",
    )
    assert req.request_id == "rid" and req.model == "m" and req.stream
    assert req.max_tokens == 7 and req.tenant == "t" and req.priority_class == "hi"
    assert len(req.prefix_hashes) == 8 and req.block_tokens == 16
    assert 1000 <= req.prompt_tokens <= 1200  # ~4 chars per token
    assert route_request(body, Endpoint.CHAT, "r", max_prefix_blocks=0).prefix_hashes == ()


def test_prefix_hashes_share_a_prefix_across_turns_and_depend_on_model() -> None:
    t1 = chat(SYSTEM, {"role": "user", "content": "y" * 1000})
    t2 = chat(
        *t1["messages"],
        {"role": "assistant", "content": "z" * 500},
        {"role": "user", "content": "more"},
    )
    r1 = route_request(t1, Endpoint.CHAT, "1", block_tokens=16, max_prefix_blocks=1000)
    r2 = route_request(t2, Endpoint.CHAT, "2", block_tokens=16, max_prefix_blocks=1000)
    n = len(r1.prefix_hashes)
    # The history is a byte prefix of the next turn: every full block carries over.
    assert n > 10 and r2.prefix_hashes[:n] == r1.prefix_hashes
    assert r2.opener_hashes == r1.opener_hashes and len(r1.opener_hashes) == 2
    other = route_request({**t1, "model": "other"}, Endpoint.CHAT, "3", max_prefix_blocks=1000)
    assert other.prefix_hashes[0] != r1.prefix_hashes[0]
    salted = route_request({**t1, "cache_salt": "s"}, Endpoint.CHAT, "4", max_prefix_blocks=1000)
    assert salted.prefix_hashes[0] != r1.prefix_hashes[0]


def test_max_completion_tokens_and_embeddings() -> None:
    req = route_request(
        chat({"role": "user", "content": "x"}, max_completion_tokens=3), Endpoint.CHAT, "r"
    )
    assert req.max_tokens == 3
    emb = route_request({"model": "m", "input": ["a", "b"]}, Endpoint.EMBEDDINGS, "r")
    assert emb.endpoint is Endpoint.EMBEDDINGS and emb.key_source == "conversation"


def test_messages_and_responses_conversations_keep_their_key_across_turns() -> None:
    from gateway.types import Endpoint as E

    first = {
        "model": "m",
        "system": "sys",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "q1"}]}],
    }
    later = {
        **first,
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": "a"},  # type: ignore[list-item]
            {"role": "user", "content": "q2"},
        ],
    }
    other = {**first, "messages": [{"role": "user", "content": "another"}]}
    k1, k2, k3 = (route_request(b, E.MESSAGES, "r").session_key for b in (first, later, other))
    assert k1 == k2 != k3
    r1 = route_request({"model": "m", "instructions": "i", "input": "q1"}, E.RESPONSES, "r")
    r2 = route_request(
        {
            "model": "m",
            "instructions": "i",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "q1"}]},
                {"type": "function_call_output", "call_id": "c", "output": "42"},
            ],
        },
        E.RESPONSES,
        "r",
    )
    assert r1.session_key == r2.session_key and r2.prompt_tokens > r1.prompt_tokens
    # The same prompt as Anthropic's body and as chat's hashes alike (the same KV on an engine).
    chat = {
        "model": "m",
        "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"}],
    }
    as_chat = route_request(chat, E.CHAT, "r", max_prefix_blocks=8, block_tokens=1)
    as_messages = route_request(first, E.MESSAGES, "r", max_prefix_blocks=8, block_tokens=1)
    assert as_chat.prefix_hashes and as_chat.prefix_hashes == as_messages.prefix_hashes


def test_non_chat_routes_have_a_prompt_size() -> None:
    from gateway.types import Endpoint as E

    cases = [
        (E.RERANK, {"model": "m", "query": "q" * 40, "documents": ["d" * 40]}),
        (E.SCORE, {"model": "m", "text_1": "a" * 40, "text_2": "b" * 40}),
        (E.TOKENIZE, {"model": "m", "prompt": "p" * 80}),
        (E.POOLING, {"model": "m", "messages": [{"role": "user", "content": "x" * 80}]}),
        (E.DETOKENIZE, {"model": "m", "tokens": list(range(20))}),
    ]
    for endpoint, body in cases:
        request = route_request(body, endpoint, "r")
        assert request.prompt_tokens >= 20 and request.endpoint is endpoint, endpoint


def test_chat_hashes_and_key_are_those_of_the_message_bytes() -> None:
    # The request path encodes chat messages in one flat pass (and joins many of them);
    # what it hashes must stay the canonical bytes of each message, in order, for any
    # number of messages, tool calls, content parts and odd roles.
    from gateway.hashing import block_hashes, model_seed
    from gateway.keys import message_pieces

    def message(i: int) -> dict[str, Any]:
        m: dict[str, Any] = {"role": ("system", "user", "assistant", "tool", "critic")[i % 5]}
        m["content"] = f"turn {i} " + "w" * (37 * i % 900)
        if i % 4 == 2:
            m["tool_calls"] = [{"id": f"c{i}", "type": "function", "function": {"name": "f"}}]
        if i % 7 == 3:
            m["content"] = [{"type": "text", "text": f"part {i}"}, {"type": "image_url"}]
        return m

    for count in (1, 2, 3, 9, 40):
        messages = [message(i) for i in range(count)]
        body = {"model": "m", "messages": messages}
        r = route_request(body, Endpoint.CHAT, "q", block_tokens=16, max_prefix_blocks=10**6)
        data = b"".join(p for m in messages for p in message_pieces(m))
        assert r.prefix_hashes == block_hashes(data, 64, model_seed("m"))
        assert len(r.prefix_hashes) == len(data) // 64
        assert r.session_key == session_key(body, Endpoint.CHAT, None)[0]


def test_plain_text_chats_hash_as_their_message_bytes() -> None:
    # Chats whose messages are all plain text are encoded as one string (gateway.keys
    # _chat_text); the bytes, the key and the lineage chain must be the piecewise ones,
    # ASCII or not, and a chat that also has a part or a tool call must agree with it.
    from gateway.hashing import block_hashes, model_seed
    from gateway.keys import message_pieces

    roles = ("system", "user", "assistant", "tool", "critic")
    for text in ("plain ", "déjà vu, 東京 "):
        for count in (1, 3, 4, 40):
            messages = [
                {"role": roles[i % 5], "content": f"{text}{i} " + "w" * (53 * i % 700)}
                for i in range(count)
            ]
            body = {"model": "m", "messages": messages}
            r = route_request(body, Endpoint.CHAT, "q", block_tokens=16, max_prefix_blocks=10**6)
            data = b"".join(p for m in messages for p in message_pieces(m))
            assert r.prefix_hashes == block_hashes(data, 64, model_seed("m"))
            assert r.session_key == session_key(body, Endpoint.CHAT, None)[0]
            # The same chat with its last message as a text part takes the piecewise path.
            parted = [
                *messages[:-1],
                {**messages[-1], "content": [{"type": "text", "text": messages[-1]["content"]}]},
            ]
            other = route_request(
                {"model": "m", "messages": parted},
                Endpoint.CHAT,
                "q",
                block_tokens=16,
                max_prefix_blocks=10**6,
            )
            assert other.lineage_hashes == r.lineage_hashes
            assert other.session_key == r.session_key
