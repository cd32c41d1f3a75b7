"""Reading and validating an OpenAI request body, before anything is routed.

Every failure is a `gateway.errors` exception with an OpenAI error body; nothing here can
raise anything else for any input (a test feeds it malformed bodies).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from gateway.asgi import Receive
from gateway.errors import BadRequest, InvalidJSON, PayloadTooLarge, UnsupportedMediaType
from gateway.types import ROUTE_SPECS, Endpoint


class ClientGone(Exception):
    """The client disconnected while we were still reading its body."""


async def read_body(receive: Receive, limit: int, declared_length: int | None) -> bytes:
    """The whole request body, refusing more than `limit` bytes without buffering them."""
    if declared_length is not None and declared_length > limit:
        raise PayloadTooLarge(
            f"request body of {declared_length} bytes exceeds the {limit}-byte limit"
        )
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientGone()
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > limit:
            raise PayloadTooLarge(f"request body exceeds the {limit}-byte limit")
        return body
    chunks = [body]
    size = len(body)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the {limit}-byte limit")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def check_content_type(value: bytes | None) -> None:
    # A missing content type is accepted (curl -d without -H); a different one is not.
    if value is None:
        return
    media = value.split(b";", 1)[0].strip().lower()
    if media not in (b"application/json", b"") and not media.endswith(b"+json"):
        raise UnsupportedMediaType(
            f"Content-Type must be application/json, got {value.decode('latin-1')!r}"
        )


_BOUNDARY = re.compile(rb'boundary\s*=\s*(?:"([^"]+)"|([^\s;"]+))', re.IGNORECASE)


def check_multipart(value: bytes | None) -> bytes:
    """The form's boundary; a 415 unless `value` is multipart/form-data with one."""
    found = _BOUNDARY.search(value) if value is not None else None
    if value is None or not value.lower().startswith(b"multipart/form-data") or found is None:
        raise UnsupportedMediaType("Content-Type must be multipart/form-data with a boundary")
    return found.group(1) or found.group(2)


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether `value` nests containers deeper than `limit` levels (itself being level 1)."""
    if limit > _RECURSIVE_LIMIT:
        return _depth_exceeds_iterative(value, limit)
    return _exceeds(value, limit)


# Far below the interpreter's recursion limit, with room for the caller's frames.
_RECURSIVE_LIMIT = 200


def _exceeds(node: Any, room: int) -> bool:
    # Recursion, not an explicit stack: one call per container is cheaper than a tuple per
    # child, and a chat body of 100K tokens has only a few containers per message.
    if room <= 0:
        return True
    if type(node) is dict:
        children: Any = node.values()
    else:
        types = set(map(type, node))  # C speed: a list of token ids is passed in one go
        if dict not in types and list not in types:
            return False
        children = node
    for child in children:
        t = type(child)
        if (t is dict or t is list) and _exceeds(child, room - 1):
            return True
    return False


def _depth_exceeds_iterative(value: Any, limit: int) -> bool:
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))
    return False


# Below this size, counting the openers (a pass over every byte) is the cheaper first test.
# Above it the walk is: counting two kinds of byte in a 400 KB prompt costs more than
# parsing it, and a chat body that large has more openers than any depth limit anyway.
_COUNT_BELOW = 16384


def parse_json(raw: bytes, max_depth: int) -> dict[str, Any]:
    if not raw:
        raise InvalidJSON("request body is empty; expected a JSON object")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidJSON(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidJSON("request body nests too deeply") from None
    if not isinstance(data, dict):
        raise InvalidJSON("request body must be a JSON object")
    size = len(raw)
    if (
        size > max_depth
        and (size >= _COUNT_BELOW or raw.count(b"[") + raw.count(b"{") > max_depth)
        and _depth_exceeds(data, max_depth)
    ):
        raise BadRequest(f"request body nests deeper than {max_depth} levels", param=None)
    return data


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _all_ints(values: list[Any]) -> bool:
    # One C-level pass (a 100K-token prompt of ids); bool is its own type, so it is refused.
    return set(map(type, values)) == {int}


def _check_prompt(value: Any, field: str) -> None:
    """str | list[str] | list[int] | list[list[int]], non-empty."""
    if isinstance(value, str):
        return
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return
        if _all_ints(value):
            return
        if all(isinstance(v, list) and v and _all_ints(v) for v in value):
            return
    raise BadRequest(
        f"'{field}' must be a string, a list of strings, or a (list of) list of token ids",
        param=field,
    )


def _check_messages(value: Any) -> None:
    if not isinstance(value, list) or not value:
        raise BadRequest(
            "'messages' must be a non-empty array of message objects", param="messages"
        )
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{i}] must be an object", param=f"messages.{i}")
        if not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}].role must be a string", param=f"messages.{i}.role")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise BadRequest(
                f"messages[{i}].content must be a string or an array of content parts",
                param=f"messages.{i}.content",
            )


_NUMERIC_FIELDS = ("max_tokens", "max_completion_tokens", "n")


def _check_items(value: Any, field: str) -> None:
    """A Responses `input`: a string or a non-empty list of item objects."""
    if isinstance(value, str) and value:
        return
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return
    raise BadRequest(f"'{field}' must be a string or a non-empty array of input items", param=field)


def _present(value: Any) -> bool:
    """A score/rerank side vLLM accepts: a non-empty text or list, or a content object."""
    if isinstance(value, str | list | dict):
        return bool(value)
    return False


# Score's body forms vLLM 0.33 accepts (`pooling/scoring/protocol.py`), first side leading.
_SCORE_PAIRS = (
    ("text_1", "text_2"),
    ("data_1", "data_2"),
    ("queries", "documents"),
    ("queries", "items"),
)


def _check_pair(body: dict[str, Any], endpoint: Endpoint) -> None:
    if endpoint is Endpoint.RERANK:
        # vLLM: `query` is a text or a multimodal content object; `documents` a list or a
        # single item (a text or a content object).
        if not _present(body.get("query")):
            raise BadRequest(
                "'query' is required and must be a string or a content object", param="query"
            )
        if not _present(body.get("documents")):
            raise BadRequest(
                "'documents' must be a non-empty array or a single document", param="documents"
            )
        return
    for a, b in _SCORE_PAIRS:
        if body.get(a) is not None and body.get(b) is not None:
            return
    raise BadRequest(
        "'text_1' and 'text_2' (or 'data_1' and 'data_2', 'queries' and 'documents', "
        "'queries' and 'items') are required",
        param="text_1",
    )


def _check_body(body: dict[str, Any], endpoint: Endpoint) -> None:
    kind = ROUTE_SPECS[endpoint].prompt
    if kind == "messages":
        _check_messages(body.get("messages"))
    elif kind == "prompt":
        _check_prompt(body.get("prompt"), "prompt")
    elif kind == "input":
        _check_prompt(body.get("input"), "input")
    elif kind == "responses":
        if body.get("input") is not None or body.get("previous_response_id") is None:
            _check_items(body.get("input"), "input")
        if (p := body.get("previous_response_id")) is not None and not isinstance(p, str):
            raise BadRequest(
                "'previous_response_id' must be a string", param="previous_response_id"
            )
    elif kind == "anthropic":
        _check_messages(body.get("messages"))
        # Only a generation needs a budget (count_tokens has none).
        if ROUTE_SPECS[endpoint].generates and not _is_int(body.get("max_tokens")):
            raise BadRequest("'max_tokens' is required and must be an integer", param="max_tokens")
    elif kind == "either":
        if "messages" in body:
            _check_messages(body.get("messages"))
        else:
            field = "prompt" if endpoint is Endpoint.TOKENIZE else "input"
            _check_prompt(body.get(field), field)
    elif kind == "tokens":
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not _all_ints(tokens):
            raise BadRequest("'tokens' must be a non-empty array of token ids", param="tokens")
    elif kind == "pair":
        _check_pair(body, endpoint)


def validate(body: dict[str, Any], endpoint: Endpoint) -> str:
    """Check the fields the gateway relies on; return the model name ("" when the body
    names none: vLLM then serves its one model, and so does the gateway when it serves one;
    the caller decides)."""
    model = body.get("model")
    if model is None:
        model = ""
    elif not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", param="model")
    _check_body(body, endpoint)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    for field in _NUMERIC_FIELDS:
        value = body.get(field)
        if value is not None and (not _is_int(value) or not 0 <= value < 1 << 31):
            raise BadRequest(f"'{field}' must be a non-negative integer below 2^31", param=field)
    return model
