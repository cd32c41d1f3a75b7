"""Growing-prefix slices of a prompt, so a warm-up can prefill it a little at a time.

An engine schedules a prefill that is already running before anything waiting (vLLM V1
does), so a live request that reaches a replica in the middle of a long warm-up waits for
all of it. Sent as a series of requests whose prompts are growing prefixes of the real
one, each about `slice_tokens` longer than the last, the warm-up leaves the engine free
between slices: each slice finds the earlier ones cached and prefills only its own part,
and the warmer sends the next one only while no live request is on the replica.

A prefix is cut at a character position proportional to the token estimate. Where the
cut falls does not matter for correctness: the engine's prefix cache keys blocks by their
tokens, so blocks a slice filled that are not a prefix of the full prompt are simply not
reused. Content that is not plain text (image parts, token-id batches) is never cut inside.
"""

from __future__ import annotations

from typing import Any


def prefix_bodies(
    body: dict[str, Any], prompt_tokens: int, slice_tokens: int
) -> list[dict[str, Any]]:
    """Request bodies whose prompts grow by about `slice_tokens` each, ending with `body`.

    `body` is a chat or completions request body; `prompt_tokens` its estimated prompt
    length. With slicing off, a short prompt, or a prompt shape that cannot be cut, the
    answer is `[body]`.
    """
    if slice_tokens <= 0 or prompt_tokens <= slice_tokens:
        return [body]
    messages = body.get("messages")
    if isinstance(messages, list):
        return [
            *(
                {**body, "messages": m}
                for m in _message_prefixes(messages, prompt_tokens, slice_tokens)
            ),
            body,
        ]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        step = max(1, len(prompt) * slice_tokens // prompt_tokens)
        cuts = range(step, len(prompt) - step // 2, step)
        return [*({**body, "prompt": prompt[:c]} for c in cuts), body]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        # Token ids: the cut is exact.
        cuts = range(slice_tokens, len(prompt) - slice_tokens // 2, slice_tokens)
        return [*({**body, "prompt": prompt[:c]} for c in cuts), body]
    return [body]


def _message_prefixes(
    messages: list[Any], prompt_tokens: int, slice_tokens: int
) -> list[list[Any]]:
    sizes = [_chars(m) for m in messages]
    total = sum(sizes)
    if total <= 0:
        return []
    step = max(1, total * slice_tokens // prompt_tokens)
    out: list[list[Any]] = []
    for cut in range(step, total - step // 2, step):
        prefix: list[Any] = []
        seen = 0
        for message, size in zip(messages, sizes):
            if seen + size <= cut:
                prefix.append(message)
                seen += size
                continue
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str) and cut > seen:
                prefix.append({**message, "content": content[: cut - seen]})
            break
        if prefix and (not out or prefix != out[-1]):
            out.append(prefix)
    return out


def _chars(message: Any) -> int:
    if not isinstance(message, dict):
        return 0
    content = message.get("content")
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        # Parts are never cut; text parts count by their length, others as a little.
        return sum(len(p.get("text", "")) if isinstance(p, dict) else 0 for p in content) or 16
    return 0
