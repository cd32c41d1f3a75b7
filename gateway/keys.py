"""Pure session-key extraction and `RouteRequest` building.

What to hash is decided here; how a key maps to a replica is the ring's business.

Session key rule (first match wins):

1. the configured session header (default ``X-Session-Id``)       -> source ``header``;
   else a parent/child agent header's own id (`agent_lineage`), else the session ids agent
   tools send on their own (``session.agent_headers``), as the header rule. A request
   naming a parent agent also gets the parent's key: its first request starts where the
   parent is (gateway.proxy.endpoint), later ones stick to its own.
2. the body's ``prompt_cache_key`` (string)                        -> source ``prompt_cache_key``
3. the body's ``user`` (string), only with ``session.user_is_session`` -> source ``user``
4. derived from the conversation itself                            -> source ``conversation``
   (the proxy then replaces it with the conversation's lineage, gateway.lineage, when the
   prompt is long enough to have prefix hashes; what follows is the fallback):
   * chat: the model, every message up to and including the *first user message*
     (normally the system prompt plus the opening question). A later turn repeats those
     messages and appends more, so it gets the same key; two conversations that share only
     a system prompt differ in their first user message, so they get different keys.
     Two conversations that open with the very same system prompt *and* first question share
     a key, which is harmless: they share that KV prefix too.
   * completions: the model and the first ``completion_key_chars`` characters of the prompt
     (a completion "conversation" grows by appending to the prompt).
   * embeddings: the model and the whole input.

Values are hashed (xxh3-128) before use, so no raw user identifiers travel further.

The prompt is encoded as one byte stream that only grows as a conversation goes on: each
chat message is a separator, its role, another separator and its content (separators go
*before* a message, so a growing last message keeps the earlier stream a prefix); a
completions prompt is its text, a token-id prompt 4 bytes per id. `prefix_hashes` are
chained xxh3 hashes of fixed-size blocks of that stream (`block_tokens` x 4 bytes, no
tokenizer on the event loop), seeded by the model, so that equal leading entries mean an
equal leading prefix on the same model; `opener_hashes` cover its first 16, 32, ... bytes
(shorter than a block), so that short conversations have a lineage too.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from itertools import accumulate
from types import MappingProxyType
from typing import Any

import orjson
import xxhash

from gateway.hashing import (
    CHARS_PER_TOKEN,
    OPENER_BYTES,
    approx_tokens,
    digest_hex,
    model_seed,
    opener_hashes,
    stream_block_hashes,
)
from gateway.lineage import TailProbe
from gateway.types import ROUTE_SPECS, Endpoint, RouteRequest, SessionKey

# Separators that cannot occur inside JSON-decoded text boundaries in a confusing way:
# they keep ("ab", "c") and ("a", "bc") apart in the hashed stream.
_ROLE_SEP = b"\x1e"
_MSG_SEP = b"\x1f"
# Message header bytes of the usual roles, built once (others are built per message).
_HEADERS: Mapping[str, bytes] = MappingProxyType(
    {
        role: _MSG_SEP + role.encode() + _ROLE_SEP
        for role in ("system", "developer", "user", "assistant", "tool", "function")
    }
)
_USER = _HEADERS["user"]
_MSG_SEP_TEXT, _ROLE_SEP_TEXT = _MSG_SEP.decode(), _ROLE_SEP.decode()


# Content parts whose text is hashed as text: chat's, Responses' and Anthropic's.
_TEXT_PARTS = frozenset(("text", "input_text", "output_text"))


def _part_bytes(content: Any) -> bytes:
    if isinstance(content, str):
        return content.encode()
    if content is None:
        return b""
    if isinstance(content, list):
        out: list[bytes] = []
        for part in content:
            if (
                isinstance(part, Mapping)
                and part.get("type") in _TEXT_PARTS
                and isinstance(part.get("text"), str)
            ):
                out.append(part["text"].encode())
            else:
                out.append(orjson.dumps(part))
        return b"".join(out)
    return orjson.dumps(content)


def _role_header(role: Any) -> bytes:
    """The bytes that open a message: separator, role, separator."""
    header = _HEADERS.get(role) if isinstance(role, str) else None
    if header is None:
        header = _MSG_SEP + (role.encode() if isinstance(role, str) else b"") + _ROLE_SEP
    return header


def message_pieces(message: Mapping[str, Any]) -> list[bytes]:
    """Canonical bytes of one chat message (role, content, tool calls), in pieces.

    The separator leads: a message whose content grows keeps its earlier bytes a prefix.
    Pieces, not one join: a 100K-token message is then never copied a second time.
    """
    pieces = [_role_header(message.get("role")), _part_bytes(message.get("content"))]
    tool_calls = message.get("tool_calls")
    if tool_calls:
        pieces.append(orjson.dumps(tool_calls))
    return pieces


# Above this many pieces a prompt is joined before it is hashed: a join costs about 2 us
# per 100 KB, each piece about half a microsecond of the streaming hash's loop (a
# 100K-token, 64-piece prompt: 91 us streamed, 66 us joined).
_JOIN_PIECES = 8


def _chat_stream(messages: Sequence[Mapping[str, Any]]) -> list[bytes]:
    """`message_pieces` of every message in one flat list, three pieces a message (the
    tool calls' piece empty when there are none), so that message i is items 3i..3i+2.

    Inlined and flat: an agent prompt carries hundreds of messages, and a call and a list
    per message cost more than encoding its text.
    """
    headers = _HEADERS
    out: list[bytes] = []
    append = out.append
    for message in messages:
        role = message.get("role")
        header = headers.get(role) if type(role) is str else None
        append(header or _role_header(role))
        content = message.get("content")
        append(content.encode() if type(content) is str else _part_bytes(content))
        tool_calls = message.get("tool_calls")
        append(orjson.dumps(tool_calls) if tool_calls else b"")
    return out


def _chat_text(messages: Sequence[Mapping[str, Any]], head: int) -> tuple[bytes, int] | None:
    """`_chat_stream` joined, built as one str and encoded once, and the byte length of
    its first `head` messages; None unless every message is a str role and str content
    without tool calls (the other messages take `_chat_stream`, with the same bytes).

    An agent prompt of a hundred messages then costs one encode and no bytes join: the
    per-message encodes and the join of their pieces cost as much as hashing it.
    """
    out: list[str] = []
    sep, role_sep = _MSG_SEP_TEXT, _ROLE_SEP_TEXT
    for message in messages:
        get = message.get
        role = get("role")
        content = get("content")
        if type(role) is not str or type(content) is not str or get("tool_calls"):
            return None
        out += (sep, role, role_sep, content)
    text = "".join(out)
    try:
        data = text.encode()
    except UnicodeEncodeError:  # lone surrogates: the piecewise path reports them
        return None
    lead = out[: 4 * head]
    end = sum(map(len, lead)) if text.isascii() else len("".join(lead).encode())
    return data, end


def _conversation_head(messages: Sequence[Mapping[str, Any]]) -> int:
    """Number of leading messages that identify a conversation (through the first user one)."""
    for i, message in enumerate(messages):
        if message.get("role") == "user":
            return i + 1
    return min(len(messages), 1) if messages else 0


def _prompt_bytes(value: Any) -> bytes:
    """Prompt/input of completions or embeddings as bytes; token ids as 4 bytes each."""
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, list) and value:
        first = value[0]
        if isinstance(first, int) and not isinstance(first, bool):
            try:
                return array("I", value).tobytes()
            except (OverflowError, TypeError):
                return orjson.dumps(value)
        if isinstance(first, str):
            return _MSG_SEP.join(s.encode() for s in value if isinstance(s, str))
        if isinstance(first, list):
            return _MSG_SEP.join(_prompt_bytes(v) for v in value)
    return orjson.dumps(value)


def _opt_str(body: Mapping[str, Any], field: str) -> str | None:
    value = body.get(field)
    return value if isinstance(value, str) and value else None


def session_key(
    body: Mapping[str, Any],
    endpoint: Endpoint,
    header_value: str | None,
    completion_key_chars: int = 1024,
    encoded: Sequence[Sequence[bytes | memoryview]] | None = None,
    user_is_session: bool = False,
) -> tuple[SessionKey, str]:
    """The session key and where it came from (see the module docstring for the rule).

    `encoded` may carry the already-encoded prompt (`prompt_pieces`) to avoid doing it twice.
    """
    if header_value:
        return SessionKey("h:" + digest_hex(header_value)), "header"
    cache_key = _opt_str(body, "prompt_cache_key")
    if cache_key is not None:
        return SessionKey("p:" + digest_hex(cache_key)), "prompt_cache_key"
    user = _opt_str(body, "user") if user_is_session else None
    if user is not None:
        # Off by default: many clients send one `user` for all their conversations.
        return SessionKey("u:" + digest_hex(user)), "user"
    model = body.get("model", "")
    hasher = xxhash.xxh3_128(f"{model}".encode() + _MSG_SEP)
    if endpoint is Endpoint.CHAT:
        messages = body.get("messages") or ()
        n = _conversation_head(messages)
        parts = encoded if encoded is not None else [message_pieces(m) for m in messages[:n]]
        for pieces in parts[:n]:
            for piece in pieces:
                hasher.update(piece)
    elif endpoint is Endpoint.COMPLETIONS:
        data = encoded[0][0] if encoded else _prompt_bytes(body.get("prompt"))
        hasher.update(memoryview(data)[:completion_key_chars])
    elif endpoint is Endpoint.EMBEDDINGS:
        hasher.update(encoded[0][0] if encoded else _prompt_bytes(body.get("input")))
    else:
        # The other routes: their messages as chat's (up to the first user turn).
        parts = encoded if encoded is not None else prompt_pieces(body, endpoint)
        n = _conversation_head(_roles(parts)) if _is_chatlike(endpoint) else len(parts)
        for pieces in parts[:n]:
            for piece in pieces:
                hasher.update(piece)
    return SessionKey("c:" + hasher.hexdigest()), "conversation"


# (agent, parent, scope) header names of one client's lineage headers, lower-case bytes.
LineagePair = tuple[bytes, bytes, bytes | None]


def agent_lineage(
    pairs: Sequence[LineagePair], found: Mapping[bytes, bytes]
) -> tuple[str | None, SessionKey | None]:
    """The request's own agent session id and its parent's session key, from the first
    pair whose agent header it carries (`found`: header name -> value); (None, None)
    when none.

    The parent's key is the one the parent's own requests get: the header rule's key of
    its id (an id within a run is read as ``run + 0x1f + id``, and a run's top-level agent,
    which sends no agent header, is keyed by the run's id alone).
    """
    for agent_name, parent_name, scope_name in pairs:
        agent = found.get(agent_name)
        if not agent:
            continue
        scope = found.get(scope_name) if scope_name is not None else None
        parent = found.get(parent_name)
        prefix = scope.decode("latin-1") + _MSG_SEP_TEXT if scope else ""
        own = prefix + agent.decode("latin-1")
        parent_id = prefix + parent.decode("latin-1") if parent else None
        if parent_id is None and scope:
            parent_id = scope.decode("latin-1")
        parent_key = SessionKey("h:" + digest_hex(parent_id)) if parent_id else None
        return own, parent_key
    return None, None


def _is_chatlike(endpoint: Endpoint) -> bool:
    return ROUTE_SPECS[endpoint].prompt in ("messages", "responses", "anthropic", "either")


def _roles(parts: Sequence[Sequence[bytes | memoryview]]) -> list[Mapping[str, Any]]:
    """Each encoded message's role again, read off its header (for `_conversation_head`)."""
    return [{"role": "user"} if p and p[0] == _USER else {} for p in parts]


def _items_pieces(items: Any) -> list[list[bytes]]:
    """Responses `input` items: messages as chat's, other items (tool calls, their outputs)
    as their JSON under a header naming their type."""
    if isinstance(items, str):
        return [[_USER, items.encode()]]
    out: list[list[bytes]] = []
    for item in items if isinstance(items, list) else ():
        if not isinstance(item, Mapping):
            continue
        if "role" in item:
            out.append(message_pieces(item))
        else:
            out.append([_role_header(item.get("type")), orjson.dumps(item)])
    return out


def _system_pieces(system: Any) -> list[list[bytes]]:
    return [[_HEADERS["system"], _part_bytes(system)]] if system else []


def _pair_pieces(body: Mapping[str, Any]) -> list[list[bytes]]:
    # The query (or first text) leads: it is what repeats across a reranking session.
    out: list[list[bytes]] = []
    for field in ("query", "text_1", "data_1", "queries", "documents", "text_2", "data_2", "items"):
        value = body.get(field)
        if value is not None:
            out.append([_MSG_SEP, _prompt_bytes(value)])
    return out


def prompt_pieces(body: Mapping[str, Any], endpoint: Endpoint) -> list[list[bytes]]:
    """The prompt as byte pieces (one list per chat message), in the order the engine sees it."""
    if endpoint is Endpoint.CHAT:
        return [message_pieces(m) for m in body.get("messages") or ()]
    if endpoint is Endpoint.COMPLETIONS:
        return [[_prompt_bytes(body.get("prompt"))]]
    if endpoint is Endpoint.EMBEDDINGS:
        return [[_prompt_bytes(body.get("input"))]]
    kind = ROUTE_SPECS[endpoint].prompt
    if kind == "anthropic":
        return _system_pieces(body.get("system")) + [
            message_pieces(m) for m in body.get("messages") or ()
        ]
    if kind == "responses":
        return _system_pieces(body.get("instructions")) + _items_pieces(body.get("input"))
    if kind == "either" and "messages" in body:
        return [message_pieces(m) for m in body.get("messages") or ()]
    if kind in ("prompt", "input", "either", "tokens"):
        field = {"prompt": "prompt", "tokens": "tokens"}.get(kind, "input")
        if kind == "either":
            field = "prompt" if endpoint is Endpoint.TOKENIZE else "input"
        value = body.get(field)
        return [[_prompt_bytes(value)]] if value is not None else []
    if kind == "pair":
        return _pair_pieces(body)
    return []


def _leading(parts: Sequence[bytes], limit: int) -> bytes:
    out: list[bytes] = []
    for part in parts:
        if len(part) >= limit:
            out.append(part[:limit])
            break
        out.append(part)
        limit -= len(part)
    return b"".join(out)


class _ChainEnds:
    """Byte offset where the prompt's `n`-th chain hash ends (openers, then blocks)."""

    __slots__ = ("_block", "_openers")

    def __init__(self, openers: int, block_bytes: int) -> None:
        self._openers, self._block = openers, block_bytes

    def __call__(self, n: int) -> int:
        if n <= self._openers:
            return OPENER_BYTES[n - 1] if n else 0
        return (n - self._openers) * self._block


class _Stream:
    """Slices of the concatenated prompt pieces, without concatenating them all."""

    __slots__ = ("_offsets", "_pieces")

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self._pieces = pieces
        self._offsets: list[int] | None = None

    def slice(self, start: int, end: int) -> bytes:
        offsets = self._offsets
        if offsets is None:
            offsets = self._offsets = [0, *accumulate(map(len, self._pieces))]
        i = bisect_right(offsets, start) - 1
        out: list[bytes] = []
        pieces = self._pieces
        while start < end and i < len(pieces):
            piece, base = pieces[i], offsets[i]
            out.append(piece[start - base : end - base])
            start = base + len(piece)
            i += 1
        return b"".join(out)


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    for field in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def route_request(
    body: Mapping[str, Any],
    endpoint: Endpoint,
    request_id: str,
    *,
    session_header: str | None = None,
    block_tokens: int = 256,
    max_prefix_blocks: int = 0,
    completion_key_chars: int = 1024,
    priority_class: str | None = None,
    tenant: str | None = None,
    user_is_session: bool = False,
    lineage: Callable[[Sequence[int], SessionKey | None, TailProbe], SessionKey | None]
    | None = None,
) -> RouteRequest:
    """Build the policy-facing view of a validated request body.

    `max_prefix_blocks` = 0 means no prefix hashes at all (the cheapest setting for
    policies that do not look at prefixes); otherwise at most that many blocks are hashed
    (with 512-token blocks, 2048 blocks cover a million tokens). `lineage` names the
    conversation of a prompt that brought no session id of its own (gateway.lineage).
    """
    model = body["model"]
    parts: Sequence[Sequence[bytes | memoryview]]
    if endpoint is Endpoint.CHAT:
        messages = body.get("messages") or ()
        head = _conversation_head(messages)
        text = _chat_text(messages, head) if 3 * len(messages) > _JOIN_PIECES else None
        if text is not None:
            pieces = [text[0]]
            parts = [[memoryview(text[0])[: text[1]]]]
        else:
            pieces = _chat_stream(messages)
            # Only the opening messages name the conversation: their pieces, not all.
            parts = [pieces[i : i + 3] for i in range(0, 3 * head, 3)]
    else:
        parts = prompt_pieces(body, endpoint)
        pieces = [piece for message in parts for piece in message]
    chatlike = endpoint is Endpoint.CHAT or _is_chatlike(endpoint)
    key, source = session_key(
        body, endpoint, session_header, completion_key_chars, parts, user_is_session
    )
    if len(pieces) > _JOIN_PIECES:
        # One message per turn: every step below then walks one piece, not hundreds.
        pieces = [b"".join(pieces)]
    size = sum(map(len, pieces))
    hashes: tuple[int, ...] = ()
    openers: tuple[int, ...] = ()
    chain: tuple[int, ...] = ()
    tail = b""
    if max_prefix_blocks:
        block_bytes = block_tokens * CHARS_PER_TOKEN
        salt = _opt_str(body, "cache_salt")
        seed = model_seed(model, salt)
        hashes = stream_block_hashes(pieces, block_bytes, seed, max_prefix_blocks)
        # Only the bytes the openers read are joined.
        openers = opener_hashes(_leading(pieces, block_bytes), block_bytes, seed)
        chain = openers + hashes
        if chain and lineage is not None and source == "conversation":
            # The tail and the probe serve the lineage index only.
            ends = _ChainEnds(len(openers), block_bytes)
            stream = _Stream(pieces)

            def probe(count: int, length: int) -> bytes:
                at = ends(count)
                return stream.slice(at, at + length)

            named = lineage(chain, key if chatlike else None, probe)
            if named is not None:
                key, source = named, "lineage"
                start = ends(len(chain))
                # Under a block, but for a prompt longer than `max_prefix_blocks` hash.
                tail = stream.slice(start, min(size, start + block_bytes))
    return RouteRequest(
        request_id=request_id,
        model=model,
        session_key=key,
        key_source=source,
        endpoint=endpoint,
        prefix_hashes=hashes,
        opener_hashes=openers,
        lineage_hashes=chain,
        lineage_tail=tail,
        block_tokens=block_tokens,
        prompt_tokens=approx_tokens(size),
        max_tokens=_max_tokens(body),
        priority_class=priority_class or "default",
        tenant=tenant,
        stream=body.get("stream") is True,
    )
