"""Private capture: OpenAI requests in, a kvgate trace of salted block hashes out.

Text is tokenized, cut into fixed-size blocks and hashed with a secret salt, all in
memory; only (hash, last block length), lengths, arrival times and a pseudonymised session
id are written. Hashes are keyed BLAKE2b, chained (block i's hash covers blocks 0..i), so
equal prefixes still give equal hashes while nobody without the salt can test a guessed
text against a hash.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from gateway.trace.format import (
    DEFAULT_BLOCK_TOKENS,
    TraceFormatError,
    TraceHeader,
    TraceRecord,
    header_line,
    record_line,
)
from gateway.trace.tokenize import Tokenizer

SALT_BYTES = 32
SALT_ENV = "KVGATE_TRACE_SALT"
_HASH_BYTES = 8
_MIN_SALT_BYTES = 16


def new_salt() -> bytes:
    return secrets.token_bytes(SALT_BYTES)


def _key(salt: bytes) -> bytes:
    # BLAKE2b takes keys of at most 64 bytes; longer salts are condensed first.
    if len(salt) < _MIN_SALT_BYTES:
        raise TraceFormatError(f"the trace salt must be at least {_MIN_SALT_BYTES} bytes")
    return salt if len(salt) <= 64 else hashlib.blake2b(salt).digest()


def salt_id(salt: bytes) -> str:
    """A short public fingerprint: tells two traces' salts apart without revealing them."""
    return hashlib.blake2b(_key(salt), digest_size=4, person=b"kvgate-salt-id").hexdigest()


def load_salt(path: str | Path | None, *, create: bool = True) -> bytes:
    """The salt from `path` (created with a fresh random salt, mode 0600, if missing),
    else from $KVGATE_TRACE_SALT, else a fresh random one for this run only."""
    if path is not None:
        p = Path(path)
        if p.exists():
            return p.read_bytes().strip()
        if not create:
            raise TraceFormatError(f"salt file {p} does not exist")
        salt = new_salt().hex().encode()
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(salt)
        return salt
    env = os.environ.get(SALT_ENV)
    if env:
        return env.encode()
    return new_salt()


class BlockHasher:
    """Chained keyed hashes of fixed-size token blocks."""

    def __init__(self, salt: bytes, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        if block_tokens <= 0:
            raise TraceFormatError("block_tokens must be positive")
        self._key = _key(salt)
        self.block_tokens = block_tokens

    def hash_blocks(self, payloads: list[bytes]) -> tuple[int, ...]:
        """Chained: each block's hash is keyed by the salt and covers the previous hash."""
        out: list[int] = []
        prev = b"\0" * _HASH_BYTES
        key = self._key
        for payload in payloads:
            prev = hashlib.blake2b(prev + payload, key=key, digest_size=_HASH_BYTES).digest()
            out.append(int.from_bytes(prev, "little"))
        return tuple(out)

    def pseudonym(self, value: str) -> str:
        digest = hashlib.blake2b(
            value.encode(), key=self._key, digest_size=_HASH_BYTES, person=b"kvgate-session"
        )
        return digest.hexdigest()


# --- reading OpenAI bodies ----------------------------------------------------------------


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, Mapping):
                if isinstance(part.get("text"), str):
                    parts.append(part["text"])
                else:
                    # Images/audio cost prompt tokens too; a stable marker keeps the
                    # prefix structure without the payload.
                    parts.append(f"[{part.get('type', 'part')}]")
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    return orjson.dumps(content, option=orjson.OPT_SORT_KEYS).decode()


def render_prompt(body: Mapping[str, Any]) -> str:
    """The prompt as one string, rendered the same way every time.

    Not a model's chat template: what matters is that an equal conversation prefix renders
    to an equal text prefix, and that the length is about right.
    """
    if "messages" in body:
        pieces: list[str] = []
        if body.get("tools"):
            pieces.append(
                "<|tools|>\n"
                + orjson.dumps(body["tools"], option=orjson.OPT_SORT_KEYS).decode()
                + "\n"
            )
        for msg in body["messages"] or ():
            if not isinstance(msg, Mapping):
                continue
            text = _content_text(msg.get("content"))
            if msg.get("tool_calls"):
                text += orjson.dumps(msg["tool_calls"], option=orjson.OPT_SORT_KEYS).decode()
            pieces.append(f"<|{msg.get('role', 'user')}|>\n{text}\n")
        pieces.append("<|assistant|>\n")
        return "".join(pieces)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        return "".join(p if isinstance(p, str) else "" for p in prompt)
    return str(prompt)


def _response_text(response: Mapping[str, Any]) -> str:
    texts: list[str] = []
    for choice in response.get("choices") or ():
        if not isinstance(choice, Mapping):
            continue
        msg = choice.get("message")
        if isinstance(msg, Mapping):
            texts.append(_content_text(msg.get("content")))
        elif isinstance(choice.get("text"), str):
            texts.append(choice["text"])
    return "".join(texts)


def output_tokens_of(
    request: Mapping[str, Any], response: Mapping[str, Any] | None, tokenizer: Tokenizer
) -> int:
    """Reported completion tokens, else the response text's length, else max_tokens."""
    if response:
        usage = response.get("usage")
        if isinstance(usage, Mapping) and isinstance(usage.get("completion_tokens"), int):
            return int(usage["completion_tokens"])
        text = _response_text(response)
        if text:
            return tokenizer.count(text)
    for key in ("max_completion_tokens", "max_tokens"):
        if isinstance(request.get(key), int):
            return int(request[key])
    return 0


def session_of(entry: Mapping[str, Any], request: Mapping[str, Any]) -> str | None:
    headers = entry.get("headers")
    candidates: list[Any] = [entry.get("session_id")]
    if isinstance(headers, Mapping):
        lowered = {str(k).lower(): v for k, v in headers.items()}
        candidates.append(lowered.get("x-session-id"))
    candidates += [request.get("prompt_cache_key"), request.get("user")]
    for c in candidates:
        if isinstance(c, str) and c:
            return c
    return None


def _timestamp_s(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        # Epoch milliseconds are 13 digits; seconds are 10.
        return float(value) / 1000.0 if value > 1e11 else float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value).timestamp()  # 3.11 reads a "Z" suffix
        except ValueError:
            return None
    return None


# --- the capturer ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CaptureInput:
    """One request as capture sees it: text and numbers that are never written as such."""

    prompt: str
    output_tokens: int
    timestamp_s: float | None = None
    session: str | None = None
    # A completions prompt sent as token ids: counted and hashed as the ids themselves.
    token_ids: tuple[int, ...] | None = None


def prompt_token_ids(body: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The ids of a `/v1/completions` prompt given as token ids (vLLM and SGLang take them)."""
    prompt = body.get("prompt")
    if "messages" in body or not isinstance(prompt, list) or not prompt:
        return None
    if all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in prompt):
        return tuple(prompt)
    return None


class Capturer:
    """Turns prompts into trace records. Holds the salt; writes nothing itself."""

    def __init__(
        self, salt: bytes, tokenizer: Tokenizer, block_tokens: int = DEFAULT_BLOCK_TOKENS
    ) -> None:
        self._hasher = BlockHasher(salt, block_tokens)
        self.tokenizer = tokenizer
        self.header = TraceHeader(
            block_tokens=block_tokens,
            tokenizer=tokenizer.name,
            salt_id=salt_id(salt),
            source="capture",
        )

    def record(self, item: CaptureInput, arrival_s: float) -> TraceRecord:
        bt = self._hasher.block_tokens
        if item.token_ids is not None:
            ids = item.token_ids
            n_tokens = len(ids)
            payloads = [
                struct.pack(f"<{len(ids[i : i + bt])}I", *ids[i : i + bt])
                for i in range(0, n_tokens, bt)
            ]
        else:
            n_tokens, payloads = self.tokenizer.blocks(item.prompt, bt)
        hashes = self._hasher.hash_blocks(payloads)
        last = n_tokens - (len(hashes) - 1) * bt if hashes else 0
        session = None if item.session is None else self._hasher.pseudonym(item.session)
        return TraceRecord(
            arrival_s=arrival_s,
            input_tokens=n_tokens,
            output_tokens=item.output_tokens,
            block_hashes=hashes,
            last_block_tokens=last,
            session_id=session,
        )

    def from_openai(self, entry: Mapping[str, Any]) -> CaptureInput:
        """One JSONL entry: a bare request body, or {"request", "response"?, "timestamp"?,
        "session_id"?, "headers"?}."""
        request = entry.get("request", entry)
        if not isinstance(request, Mapping) or not ("messages" in request or "prompt" in request):
            raise TraceFormatError("entry has no OpenAI request (messages or prompt)")
        response = entry.get("response")
        response = response if isinstance(response, Mapping) else None
        ts = _timestamp_s(entry.get("timestamp"))
        if ts is None and response is not None:
            ts = _timestamp_s(response.get("created"))
        return CaptureInput(
            prompt=render_prompt(request),
            output_tokens=output_tokens_of(request, response, self.tokenizer),
            timestamp_s=ts,
            session=session_of(entry, request),
            token_ids=prompt_token_ids(request),
        )


def capture_openai_jsonl(
    src: BinaryIO, dst: BinaryIO, capturer: Capturer, name: str = "<input>"
) -> int:
    """Capture every request of `src` (JSONL) into `dst`; returns the number written.

    Arrival times are taken relative to the earliest timestamp; entries without one get
    the previous entry's time. Output is sorted by arrival.
    """
    items: list[tuple[float | None, int, CaptureInput]] = []
    for lineno, raw in enumerate(src, 1):
        if not raw.strip():
            continue
        try:
            entry = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise TraceFormatError(f"{name}:{lineno}: not JSON ({exc})") from exc
        if not isinstance(entry, Mapping):
            raise TraceFormatError(f"{name}:{lineno}: expected a JSON object")
        try:
            item = capturer.from_openai(entry)
        except TraceFormatError as exc:
            raise TraceFormatError(f"{name}:{lineno}: {exc.message}") from exc
        items.append((item.timestamp_s, lineno, item))
    dst.write(header_line(capturer.header))
    dst.writelines(record_line(rec) for rec in _records(items, capturer))
    return len(items)


def _records(
    items: list[tuple[float | None, int, CaptureInput]], capturer: Capturer
) -> Iterator[TraceRecord]:
    known = [t for t, _, _ in items if t is not None]
    t0 = min(known) if known else 0.0
    last = t0
    timed: list[tuple[float, int, CaptureInput]] = []
    for ts, lineno, item in items:
        last = ts if ts is not None else last
        timed.append((last, lineno, item))
    timed.sort(key=lambda x: (x[0], x[1]))
    for ts, _, item in timed:
        yield capturer.record(item, ts - t0)
