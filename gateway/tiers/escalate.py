"""Pure checks of a small tier's whole (non-streamed) answer: which one failed, if any.

Checks, in this order (`Escalation.checks` picks which run):

* `error`: a 5xx or 429 from the tier (with `on_error`), before any byte reached the client;
* `length` / `content_filter`: the answer's `finish_reason`;
* `empty`: no text and no tool call;
* `refusal`: the `refusal` field, or text opening like a refusal (English phrases only);
* `json`: `response_format` asked for JSON and the text does not parse, or (json_schema)
  lacks a key the schema's top level `required` lists;
* `logprob`: logprobs were returned and their mean is under `min_mean_logprob`.

Only chat and completions answers are read; anything else passes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from gateway.tiers.config import Escalation
from gateway.types import Endpoint

REFUSAL_OPENINGS = (
    "i'm sorry, but i can",
    "i am sorry, but i can",
    "sorry, i can't",
    "sorry, i cannot",
    "i can't help with",
    "i cannot help with",
    "i can't assist with",
    "i cannot assist with",
    "i'm unable to",
    "i am unable to",
)
CHECKED_ENDPOINTS = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS})


def failed_check(
    escalation: Escalation,
    endpoint: Endpoint,
    status: int,
    payload: bytes,
    request: Mapping[str, Any],
) -> str | None:
    """The first failed check's name, or None when the answer may go to the client."""
    if status >= 500 or status == 429:
        return "error" if escalation.on_error else None
    if status >= 400 or endpoint not in CHECKED_ENDPOINTS:
        return None  # the client's own mistake: a bigger model would not fix it
    try:
        answer = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return "error" if escalation.on_error else None
    choices = answer.get("choices") if isinstance(answer, Mapping) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return "empty" if "empty" in escalation.checks else None
    choice: Mapping[str, Any] = choices[0]
    checks = escalation.checks
    finish = choice.get("finish_reason")
    if finish == "length" and "length" in checks:
        return "length"
    if finish == "content_filter" and "content_filter" in checks:
        return "content_filter"
    message = choice.get("message")
    if isinstance(message, Mapping):
        text = message.get("content")
        tool_calls = message.get("tool_calls")
        refusal = message.get("refusal")
    else:
        text, tool_calls, refusal = choice.get("text"), None, None
    text = text if isinstance(text, str) else ""
    if "empty" in checks and not text.strip() and not tool_calls:
        return "empty"
    if "refusal" in checks and (refusal or _looks_refused(text)):
        return "refusal"
    if "json" in checks and not tool_calls and not _json_ok(text, request):
        return "json"
    if "logprob" in checks:
        mean = mean_logprob(choice.get("logprobs"))
        if mean is not None and mean < escalation.min_mean_logprob:
            return "logprob"
    return None


def _looks_refused(text: str) -> bool:
    opening = text.lstrip()[:48].lower().replace("\u2019", "'")
    return opening.startswith(REFUSAL_OPENINGS)


def _json_ok(text: str, request: Mapping[str, Any]) -> bool:
    fmt = request.get("response_format")
    if not isinstance(fmt, Mapping) or fmt.get("type") not in ("json_object", "json_schema"):
        return True
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return False
    if fmt.get("type") == "json_object":
        return isinstance(value, dict)
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, Mapping) else None
    if not isinstance(schema, Mapping):
        return True
    if schema.get("type") == "object" and not isinstance(value, dict):
        return False
    required = schema.get("required")
    if isinstance(required, list) and isinstance(value, dict):
        return all(key in value for key in required)
    return True


def mean_logprob(logprobs: Any) -> float | None:
    """Mean token logprob of a chat (`content[*].logprob`) or completions
    (`token_logprobs`) answer; None when there are none."""
    if not isinstance(logprobs, Mapping):
        return None
    values: Sequence[Any]
    content = logprobs.get("content")
    if isinstance(content, list):
        values = [item.get("logprob") for item in content if isinstance(item, Mapping)]
    else:
        tokens = logprobs.get("token_logprobs")
        values = tokens if isinstance(tokens, list) else ()
    numbers = [float(v) for v in values if isinstance(v, int | float)]
    if not numbers:
        return None
    return sum(numbers) / len(numbers)
