"""Prompt tokenization for the simulator.

The default `ApproxTokenizer` needs no vocabulary file: one token per 4 characters, cut at
fixed offsets. That keeps two properties that matter for prefix caching: it is
deterministic, and a text that extends another text shares all of its whole blocks. A real
`tokenizer.json` can be used instead when the optional `tokenizers` package is installed.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import xxhash

CHARS_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class Tokenized:
    num_tokens: int
    # One byte string per *whole* block of the prompt, block i covering tokens
    # [i*block_size, (i+1)*block_size); the partial last block is not cached, so not listed.
    block_payloads: tuple[bytes, ...]


class Tokenizer(Protocol):
    def encode(self, text: str, block_size: int) -> Tokenized: ...

    def count(self, text: str) -> int: ...

    def ids(self, text: str) -> Sequence[int]: ...


def token_ids_text(ids: Sequence[int]) -> str:
    """A token-id prompt as the simulator reads it: 4 hex characters an id, so that the
    4-characters-a-token tokenizer keeps one token per id."""
    return "".join(f"{p & 0xFFFF:04x}" for p in ids)


def approx_token_ids(text: str) -> Sequence[int]:
    """Token ids of `ApproxTokenizer`: one per 4 characters (ASCII: the 4 bytes themselves,
    little-endian; otherwise a 31-bit hash of the characters), what the simulated engine
    publishes in its KV events and the gateway's tokenizer stage reproduces."""
    n = -(-len(text) // CHARS_PER_TOKEN)
    data = text.encode("utf-8", "surrogatepass")
    if len(data) == len(text):
        padded = data + b"\0" * (n * CHARS_PER_TOKEN - len(data))
        return array("I", padded)
    return array(
        "I",
        (
            xxhash.xxh32_intdigest(text[i : i + CHARS_PER_TOKEN].encode("utf-8", "surrogatepass"))
            & 0x7FFF_FFFF
            for i in range(0, len(text), CHARS_PER_TOKEN)
        ),
    )


class ApproxTokenizer:
    """About 4 characters a token, no vocabulary (fast even for 100K-token prompts)."""

    def count(self, text: str) -> int:
        return -(-len(text) // CHARS_PER_TOKEN)

    def ids(self, text: str) -> Sequence[int]:
        return approx_token_ids(text)

    def encode(self, text: str, block_size: int) -> Tokenized:
        span = CHARS_PER_TOKEN * block_size
        n_blocks = len(text) // span
        data = text.encode("utf-8", "surrogatepass")
        if len(data) == len(text):
            payloads = tuple(data[i * span : (i + 1) * span] for i in range(n_blocks))
        else:
            payloads = tuple(
                text[i * span : (i + 1) * span].encode("utf-8", "surrogatepass")
                for i in range(n_blocks)
            )
        return Tokenized(self.count(text), payloads)


class FileTokenizer:
    """A HuggingFace `tokenizer.json` (requires the optional `tokenizers` package)."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise RuntimeError("a tokenizer file needs the 'tokenizers' package") from exc
        self._tok = HFTokenizer.from_file(path)

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def ids(self, text: str) -> Sequence[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        return ids

    def encode(self, text: str, block_size: int) -> Tokenized:
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        n_blocks = len(ids) // block_size
        payloads = tuple(
            b"".join(i.to_bytes(4, "little") for i in ids[b * block_size : (b + 1) * block_size])
            for b in range(n_blocks)
        )
        return Tokenized(len(ids), payloads)


def chain_block_hashes(payloads: Sequence[bytes], salt: str | None = None) -> tuple[int, ...]:
    """Chained block hashes: block i's hash covers blocks 0..i (and the cache salt)."""
    parent = xxhash.xxh64_intdigest(salt.encode()) if salt else 0
    out: list[int] = []
    for payload in payloads:
        parent = xxhash.xxh64_intdigest(payload, seed=parent)
        out.append(parent)
    return tuple(out)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    return str(content)


def render_chat(messages: Sequence[Mapping[str, Any]]) -> str:
    """A fixed chat template; appending turns only appends text, so earlier blocks survive."""
    pieces = [
        f"<|{m.get('role', 'user')}|>\n{_content_text(m.get('content'))}<|end|>\n" for m in messages
    ]
    pieces.append("<|assistant|>\n")
    return "".join(pieces)
