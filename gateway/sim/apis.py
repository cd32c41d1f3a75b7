"""The Responses API and Anthropic's Messages API on the simulated engine, as vLLM serves
them: each body becomes chat messages (one chat template for all, so the prefix cache sees
the same tokens), and the answer is rendered in the API's own objects and stream events.

Pure functions; the stored Responses (`previous_response_id`) live on the engine
(gateway.sim.server), which passes a lookup in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from gateway.sim.wire import WireError

Message = Mapping[str, Any]
History = Callable[[str], Sequence[Message] | None]

_TEXT_PARTS = ("text", "input_text", "output_text")


def _text(content: Any) -> Any:
    """Responses / Anthropic content parts as chat content (text parts kept, others JSON)."""
    if not isinstance(content, list):
        return content
    parts: list[str] = []
    for part in content:
        if isinstance(part, Mapping) and part.get("type") in _TEXT_PARTS:
            parts.append(str(part.get("text", "")))
        else:
            parts.append(orjson.dumps(part).decode())
    return "".join(parts)


def responses_messages(body: Mapping[str, Any], history: History) -> list[Message]:
    """`instructions`, the stored conversation of `previous_response_id`, then `input`."""
    out: list[Message] = []
    instructions = body.get("instructions")
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise WireError(400, "'previous_response_id' must be a string", "previous_response_id")
        earlier = history(previous)
        if earlier is None:
            raise WireError(404, f"Response with id '{previous}' not found.")
        out.extend(m for m in earlier if m.get("role") != "system")
    if isinstance(instructions, str) and instructions:
        out.insert(0, {"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        out.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            if not isinstance(item, Mapping):
                raise WireError(400, "each 'input' item must be an object", "input")
            if "role" in item:
                out.append({"role": item["role"], "content": _text(item.get("content"))})
            else:  # a tool call or its output: shown to the model as its JSON
                out.append({"role": "tool", "content": orjson.dumps(item).decode()})
    elif previous is None:
        raise WireError(400, "'input' must be a string or a list of items", "input")
    if not out:
        raise WireError(400, "'input' is empty", "input")
    return out


def anthropic_messages(body: Mapping[str, Any], *, budget: bool = True) -> list[Message]:
    """Chat messages of a Messages body; `budget`: `max_tokens` is required (a generation;
    `count_tokens` has none)."""
    messages = body.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, Mapping) for m in messages)
    ):
        raise WireError(400, "messages: must be a non-empty list of objects", "messages")
    tokens = body.get("max_tokens")
    if budget and (not isinstance(tokens, int) or isinstance(tokens, bool)):
        raise WireError(400, "max_tokens: Field required", "max_tokens")
    out: list[Message] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": _text(system)})
    out.extend({"role": m.get("role"), "content": _text(m.get("content"))} for m in messages)
    return out


def anthropic_error(status: int, message: str) -> bytes:
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        503: "overloaded_error",
    }.get(status, "api_error")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


def event(name: str, obj: Mapping[str, Any]) -> bytes:
    """One SSE event with its name, as both APIs stream them."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


# ---- Responses --------------------------------------------------------------------------


def response_object(
    rid: str,
    model: str,
    echo: Mapping[str, Any],
    *,
    text: str | None,
    finish_reason: str | None,
    prompt_tokens: int = 0,
    output_tokens: int = 0,
    cached_tokens: int = 0,
    status: str | None = None,
) -> dict[str, Any]:
    """A Responses API `response` object; `text=None`: not finished, no output yet
    (`status` then says how far it is: "in_progress" unless told, "queued" in background)."""
    done = text is not None
    incomplete = finish_reason == "length"
    output: list[dict[str, Any]] = []
    if done:
        output.append(_message_item(rid, text or "", "incomplete" if incomplete else "completed"))
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": ("incomplete" if incomplete else "completed")
        if done
        else status or "in_progress",
        "background": bool(echo.get("background", False)),
        "store": echo.get("store", True) is not False,
        "incomplete_details": {"reason": "max_output_tokens"} if done and incomplete else None,
        "instructions": echo.get("instructions"),
        "max_output_tokens": echo.get("max_output_tokens"),
        "previous_response_id": echo.get("previous_response_id"),
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "temperature": echo.get("temperature", 1.0),
        "top_p": echo.get("top_p", 1.0),
        "truncation": "disabled",
        "error": None,
        "metadata": None,
        "usage": {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens,
        }
        if done
        else None,
    }


def _message_item(rid: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": "msg_" + rid.removeprefix("resp_"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


class ResponsesStream:
    """The event sequence of a streamed Response, numbered as the API numbers them."""

    def __init__(self, rid: str, model: str, echo: Mapping[str, Any]) -> None:
        self.rid, self.model, self.echo = rid, model, echo
        self.item_id = "msg_" + rid.removeprefix("resp_")
        self.seq = 0
        self.text: list[str] = []
        self.final: dict[str, Any] = {}  # the completed `response` object, once closed

    def _ev(self, name: str, **fields: Any) -> bytes:
        out = event(name, {"type": name, "sequence_number": self.seq, **fields})
        self.seq += 1
        return out

    def opening(self) -> bytes:
        pending = response_object(self.rid, self.model, self.echo, text=None, finish_reason=None)
        item = {**_message_item(self.rid, "", "in_progress"), "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return b"".join(
            (
                self._ev("response.created", response=pending),
                self._ev("response.in_progress", response=pending),
                self._ev("response.output_item.added", output_index=0, item=item),
                self._ev(
                    "response.content_part.added",
                    item_id=self.item_id,
                    output_index=0,
                    content_index=0,
                    part=part,
                ),
            )
        )

    def error(self, code: str, message: str) -> bytes:
        """The API's `error` event: a failure after the stream began."""
        return self._ev("error", code=code, message=message, param=None)

    def delta(self, text: str) -> bytes:
        self.text.append(text)
        return self._ev(
            "response.output_text.delta",
            item_id=self.item_id,
            output_index=0,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def closing(self, finish_reason: str | None, prompt: int, output: int, cached: int) -> bytes:
        text = "".join(self.text)
        final = response_object(
            self.rid,
            self.model,
            self.echo,
            text=text,
            finish_reason=finish_reason,
            prompt_tokens=prompt,
            output_tokens=output,
            cached_tokens=cached,
        )
        self.final = final
        item = final["output"][0]
        return b"".join(
            (
                self._ev(
                    "response.output_text.done",
                    item_id=self.item_id,
                    output_index=0,
                    content_index=0,
                    text=text,
                    logprobs=[],
                ),
                self._ev(
                    "response.content_part.done",
                    item_id=self.item_id,
                    output_index=0,
                    content_index=0,
                    part=item["content"][0],
                ),
                self._ev("response.output_item.done", output_index=0, item=item),
                self._ev(
                    "response.completed"
                    if final["status"] == "completed"
                    else "response.incomplete",
                    response=final,
                ),
            )
        )


# ---- Anthropic Messages -----------------------------------------------------------------


def _stop_reason(finish_reason: str | None) -> str:
    return "max_tokens" if finish_reason == "length" else "end_turn"


def message_object(
    rid: str,
    model: str,
    text: str,
    finish_reason: str | None,
    prompt: int,
    output: int,
    cached: int,
) -> dict[str, Any]:
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": _stop_reason(finish_reason),
        "stop_sequence": None,
        "usage": {
            "input_tokens": prompt - cached,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
            "output_tokens": output,
        },
    }


def message_opening(rid: str, model: str, prompt: int, cached: int) -> bytes:
    start: dict[str, Any] = {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": prompt - cached,
            "cache_read_input_tokens": cached,
            "output_tokens": 0,
        },
    }
    return event("message_start", {"type": "message_start", "message": start}) + event(
        "content_block_start",
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    )


def message_delta(text: str) -> bytes:
    return event(
        "content_block_delta",
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "text_delta", "text": text},
        },
    )


def message_closing(finish_reason: str | None, prompt: int, output: int, cached: int) -> bytes:
    return b"".join(
        (
            event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": _stop_reason(finish_reason), "stop_sequence": None},
                    # Cumulative, as the API sends it: a client reading only this event has it all.
                    "usage": {
                        "input_tokens": prompt - cached,
                        "cache_read_input_tokens": cached,
                        "output_tokens": output,
                    },
                },
            ),
            event("message_stop", {"type": "message_stop"}),
        )
    )
