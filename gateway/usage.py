"""Token usage from an OpenAI response, read cheaply after the fact.

Non-streaming: one JSON parse of the body. Streaming: the proxy keeps only the tail of the
stream; vLLM (with `stream_options.include_usage`) puts the usage in the last data event
before `[DONE]`, so only that event is parsed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

USAGE_TAIL_BYTES = 16384


def usage_from_json(raw: bytes) -> dict[str, Any] | None:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    usage = data.get("usage")
    if usage is None and isinstance(data.get("response"), dict):
        usage = data["response"].get("usage")  # a Responses stream's closing event
    if usage is None and isinstance(data.get("meta_info"), dict):
        usage = _from_meta_info(data["meta_info"])
    return usage if isinstance(usage, dict) else None


def _from_meta_info(meta: dict[str, Any]) -> dict[str, Any] | None:
    """SGLang's native answers (`/generate`) count tokens in `meta_info`, the cached ones
    as a plain `cached_tokens` (device and host tiers together), not in OpenAI's usage."""
    if "prompt_tokens" not in meta:
        return None
    usage: dict[str, Any] = {
        k: meta[k] for k in ("prompt_tokens", "completion_tokens") if k in meta
    }
    if "cached_tokens" in meta:
        usage["prompt_tokens_details"] = {"cached_tokens": meta["cached_tokens"]}
    return usage


def usage_from_sse(tail: bytes) -> dict[str, Any] | None:
    """The last non-null `usage` object among the SSE events in `tail`."""
    if b'"usage":{' not in tail and b'"usage": {' not in tail and b'"meta_info"' not in tail:
        return None
    for event in reversed(tail.split(b"\n\n")):
        line = event.strip()
        if line.startswith(b"event:"):  # a named event (Responses, Anthropic): its data line
            line = line.partition(b"\n")[2].strip()
        if line.startswith(b"data:") and (b'"usage"' in line or b'"meta_info"' in line):
            usage = usage_from_json(line[5:].strip())
            if usage is not None:
                return usage
    return None


def usage_tokens(usage: Mapping[str, Any] | None) -> tuple[int | None, int | None, int | None]:
    """(prompt, cached, completion) tokens; None where the engine did not say."""
    if usage is None:
        return None, None, None

    def count(value: Any) -> int | None:
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    if "prompt_tokens" in usage or "input_tokens" not in usage:
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return (
            count(usage.get("prompt_tokens")),
            count(cached),
            count(usage.get("completion_tokens")),
        )
    # Responses (`input_tokens_details`) and Anthropic (`cache_read_input_tokens`, which
    # its `input_tokens` leave out).
    prompt = count(usage.get("input_tokens"))
    details = usage.get("input_tokens_details")
    cached = count(details.get("cached_tokens")) if isinstance(details, dict) else None
    read = count(usage.get("cache_read_input_tokens"))
    if read is not None:
        cached = read
        prompt = None if prompt is None else prompt + read
    return prompt, cached, count(usage.get("output_tokens"))
