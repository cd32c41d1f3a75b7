"""vLLM's OpenAI wire format for the simulated engine: parse bodies, build answers.

Pure functions over dicts; no Starlette. Errors use vLLM's body
``{"error": {"message", "type": "<Class>Error", "param": null, "code": <status>}}``.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal

import orjson
import xxhash

from gateway.sim.tokenizer import render_chat, token_ids_text

Kind = Literal["chat", "completions", "responses", "messages"]

_WORDS = (
    "the",
    "cache",
    "of",
    "a",
    "token",
    "block",
    "prefix",
    "and",
    "to",
    "engine",
    "is",
    "in",
    "replica",
    "that",
    "for",
    "decode",
    "it",
    "with",
    "as",
    "queue",
    "on",
    "was",
    "prefill",
    "by",
    "memory",
    "this",
    "batch",
    "from",
    "at",
    "router",
    "be",
    "session",
    "or",
    "are",
    "kernel",
    "an",
    "which",
    "request",
    "but",
    "latency",
    "not",
    "have",
    "stream",
    "they",
    "model",
    "we",
    "page",
    "one",
    "all",
    "hit",
    "can",
    "their",
)


class WireError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param)


def error_type(status: int) -> str:
    try:
        phrase = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    except ValueError:
        phrase = "Server" if status >= 500 else "BadRequest"
    return phrase if phrase.endswith("Error") else phrase + "Error"


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}
    )


@dataclass(frozen=True, slots=True)
class Bootstrap:
    host: str
    port: int
    room: int


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: Kind
    model: str | None
    text: str
    max_tokens: int | None
    stream: bool
    include_usage: bool
    continuous_usage: bool
    priority: int
    ignore_eos: bool
    cache_salt: str | None
    kv_transfer_params: Mapping[str, Any] | None
    bootstrap: Bootstrap | None
    body_request_id: str | None
    # Responses and Messages: the conversation as chat messages (a Responses answer is
    # stored with it, for `previous_response_id`), and what the API echoes back.
    conversation: tuple[Mapping[str, Any], ...] = ()
    echo: Mapping[str, Any] | None = None


def _opt_int(body: Mapping[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(400, f"'{key}' must be an integer", key)
    if value < minimum:
        raise WireError(400, f"'{key}' must be at least {minimum}, got {value}", key)
    return value


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return token_ids_text(prompt)
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return prompt[0]
        raise WireError(400, "the simulator accepts a single prompt per request", "prompt")
    raise WireError(400, "'prompt' must be a non-empty string or list of token ids", "prompt")


def parse_generation(
    raw: bytes,
    kind: Kind,
    to_chat: Callable[[Mapping[str, Any]], Sequence[Mapping[str, Any]]] | None = None,
) -> ParsedRequest:
    """Validate a generation body the way vLLM answers bad ones (400). `to_chat` turns the
    body of another API (Responses, Messages) into chat messages (gateway.sim.apis)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise WireError(400, f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise WireError(400, "the request body must be a JSON object")
    conversation: tuple[Mapping[str, Any], ...] = ()
    if to_chat is not None:
        conversation = tuple(to_chat(body))
        text = render_chat(conversation)
    elif kind == "chat":
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) for m in messages)
        ):
            raise WireError(400, "'messages' must be a non-empty list of objects", "messages")
        text = render_chat(messages)
    else:
        text = _prompt_text(body.get("prompt"))
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise WireError(400, "'model' must be a string", "model")
    n = _opt_int(body, "n", 1)
    if n is not None and n != 1:
        raise WireError(400, "the simulated engine supports n=1 only", "n")
    max_tokens = _opt_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_output_tokens", 1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise WireError(400, "'stream' must be a boolean", "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise WireError(
                400, "Stream options can only be defined when `stream=True`.", "stream_options"
            )
        if not isinstance(options, dict):
            raise WireError(400, "'stream_options' must be an object", "stream_options")
    options = options or {}
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise WireError(400, "'priority' must be an integer", "priority")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise WireError(400, "'cache_salt' must be a string", "cache_salt")
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise WireError(400, "'kv_transfer_params' must be an object", "kv_transfer_params")
    bootstrap = None
    if body.get("bootstrap_room") is not None:
        host, port, room = (
            body.get("bootstrap_host"),
            body.get("bootstrap_port"),
            body["bootstrap_room"],
        )
        if not isinstance(host, str) or not isinstance(port, int) or not isinstance(room, int):
            raise WireError(
                400, "bootstrap_host/port/room must be a string and two integers", "bootstrap_room"
            )
        bootstrap = Bootstrap(host, port, room)
    rid = body.get("request_id")
    return ParsedRequest(
        kind=kind,
        model=model,
        text=text,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        continuous_usage=bool(options.get("continuous_usage_stats", False)),
        priority=priority,
        ignore_eos=bool(body.get("ignore_eos", False)),
        cache_salt=salt,
        kv_transfer_params=kv,
        bootstrap=bootstrap,
        body_request_id=rid if isinstance(rid, str) else None,
        conversation=conversation,
        echo=body if to_chat is not None else None,
    )


class OutputText:
    """Deterministic output words for one request (seeded by engine seed and prompt)."""

    def __init__(self, seed: int, output_seed: int) -> None:
        self._rng = random.Random(seed * 1_000_003 + output_seed)
        self.count = 0

    def take(self, n: int) -> str:
        words = self._rng.choices(_WORDS, k=n)
        text = " ".join(words)
        out = text if self.count == 0 else " " + text
        self.count += n
        return out

    def tokens(self, n: int) -> Iterator[str]:
        for _ in range(n):
            yield self.take(1)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def response_id(kind: Kind, request_id: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id


def full_response(
    kind: Kind,
    rid: str,
    model: str,
    text: str,
    finish_reason: str | None,
    use: dict[str, Any],
    kv_transfer_params: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    created = int(time.time())
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        obj = "text_completion"
    out: dict[str, Any] = {
        "id": response_id(kind, rid),
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": use,
    }
    out["kv_transfer_params"] = dict(kv_transfer_params) if kv_transfer_params else None
    return out


def sse(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def chunk(
    kind: Kind,
    rid: str,
    model: str,
    created: int,
    *,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    with_usage_null: bool = False,
    use: dict[str, Any] | None = None,
) -> bytes:
    if kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    if finish_reason is not None:
        choice["stop_reason"] = None
    out: dict[str, Any] = {
        "id": response_id(kind, rid),
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if use is not None:
        out["usage"] = use
    elif with_usage_null:
        out["usage"] = None
    return sse(out)


def usage_chunk(kind: Kind, rid: str, model: str, created: int, use: dict[str, Any]) -> bytes:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return sse(
        {
            "id": response_id(kind, rid),
            "object": obj,
            "created": created,
            "model": model,
            "choices": [],
            "usage": use,
        }
    )


def mid_stream_error(status: int, message: str) -> bytes:
    return b"data: " + error_body(status, message) + b"\n\n"


def embeddings(
    raw: bytes, model: str, dim: int = 32, serves: Callable[[str], bool] | None = None
) -> tuple[dict[str, Any], int]:
    """Deterministic unit vectors; returns (response body, prompt tokens). `serves`: which
    model names the engine answers (a body naming another is a 404, as in vLLM)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise WireError(400, f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise WireError(400, "the request body must be a JSON object")
    name = body.get("model")
    if isinstance(name, str) and not (serves(name) if serves else name == model):
        raise WireError(404, f"The model `{name}` does not exist.", "model")
    inputs = body.get("input")
    items: Sequence[Any]
    if isinstance(inputs, str):
        items = [inputs]
    elif isinstance(inputs, list) and inputs:
        items = inputs
    else:
        raise WireError(400, "'input' must be a string or a non-empty list", "input")
    data = []
    tokens = 0
    for i, item in enumerate(items):
        text = item if isinstance(item, str) else orjson.dumps(item).decode()
        tokens += max(1, math.ceil(len(text) / 4))
        h = xxhash.xxh64_intdigest(text.encode())
        rng = random.Random(h)
        vec = [rng.gauss(0.0, 1.0) for _ in range(dim)]
        norm = math.sqrt(sum(v * v for v in vec)) or 1.0
        data.append({"index": i, "object": "embedding", "embedding": [v / norm for v in vec]})
    out = {
        "id": f"embd-{xxhash.xxh64_hexdigest(raw)}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {
            "prompt_tokens": tokens,
            "total_tokens": tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
        },
    }
    return out, tokens
