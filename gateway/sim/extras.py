"""vLLM's other endpoints on the simulated engine: tokenize, detokenize, rerank, score,
classify, pooling, and the audio uploads (speech is gateway.sim.speech). Deterministic
bodies in vLLM's shapes, cheap to make: none of them occupies the simulated GPU (their cost
is not what the gateway's tests measure).

Each function takes the raw body and returns (status, JSON-able body); `WireError` for a bad one.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson
import xxhash

from gateway.sim.tokenizer import render_chat
from gateway.sim.wire import WireError

Ids = Callable[[str], Sequence[int]]


def _body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise WireError(400, f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise WireError(400, "the request body must be a JSON object")
    return body


def _texts(value: Any, field: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        return [v if isinstance(v, str) else orjson.dumps(v).decode() for v in value]
    raise WireError(400, f"'{field}' must be a string or a non-empty list", field)


def _tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / 4))


def _unit(seed: str) -> float:
    """A deterministic score in (0, 1) for a text."""
    return (xxhash.xxh64_intdigest(seed.encode()) % 1_000_000 + 1) / 1_000_002


def _usage(tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }


def tokenize(raw: bytes, ids: Ids, max_model_len: int) -> dict[str, Any]:
    body = _body(raw)
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise WireError(400, "'messages' must be a non-empty list", "messages")
        text = render_chat(messages)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise WireError(400, "'prompt' must be a string", "prompt")
        text = prompt
    tokens = list(ids(text))
    strs = [_piece(t) for t in tokens] if body.get("return_token_strs") else None
    return {
        "count": len(tokens),
        "max_model_len": max_model_len,
        "tokens": tokens,
        "token_strs": strs,
    }


def _piece(token: int) -> str:
    """The approximate tokenizer's ids are 4 ASCII bytes (gateway.sim.tokenizer)."""
    data = struct.pack("<I", token & 0xFFFFFFFF).rstrip(b"\0")
    return data.decode("latin-1") if all(32 <= b < 127 or b in (9, 10) for b in data) else "?"


def detokenize(raw: bytes) -> dict[str, Any]:
    tokens = _body(raw).get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise WireError(400, "'tokens' must be a list of non-negative integers", "tokens")
    return {"prompt": "".join(_piece(t) for t in tokens)}


def rerank(raw: bytes, model: str) -> dict[str, Any]:
    body = _body(raw)
    query = body.get("query")
    if isinstance(query, dict):  # vLLM: a multimodal content object
        query = orjson.dumps(query).decode()
    if not isinstance(query, str):
        raise WireError(400, "'query' must be a string or a content object", "query")
    documents = body.get("documents")
    documents = _texts([documents] if isinstance(documents, dict) else documents, "documents")
    top_n = body.get("top_n") or len(documents)
    results = sorted(
        (
            {"index": i, "document": {"text": d}, "relevance_score": _unit(query + "\0" + d)}
            for i, d in enumerate(documents)
        ),
        key=lambda r: -float(r["relevance_score"]),  # type: ignore[arg-type]
    )[:top_n]
    tokens = sum(_tokens(query) + _tokens(d) for d in documents)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": model,
        "usage": {"total_tokens": tokens},
        "results": results,
    }


def score(raw: bytes, model: str) -> dict[str, Any]:
    body = _body(raw)
    # vLLM 0.33's four forms: text_1/text_2, data_1/data_2, queries + documents or items.
    first = body.get("text_1", body.get("data_1", body.get("queries")))
    second = body.get("text_2", body.get("data_2", body.get("documents", body.get("items"))))
    a, b = _texts(first, "text_1"), _texts(second, "text_2")
    if len(a) == 1:
        a = a * len(b)
    if len(a) != len(b):
        raise WireError(400, "text_1 and text_2 must have the same length (or text_1 one item)")
    data = [
        {"index": i, "object": "score", "score": _unit(x + "\0" + y)}
        for i, (x, y) in enumerate(zip(a, b, strict=True))
    ]
    tokens = sum(_tokens(x) + _tokens(y) for x, y in zip(a, b, strict=True))
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": _usage(tokens),
    }


_LABELS = ("negative", "positive")


def classify(raw: bytes, model: str) -> dict[str, Any]:
    texts = _texts(_body(raw).get("input"), "input")
    data = []
    for i, text in enumerate(texts):
        p = _unit(text)
        data.append(
            {
                "index": i,
                "label": _LABELS[p >= 0.5],
                "probs": [1 - p, p],
                "num_classes": len(_LABELS),
            }
        )
    return {
        "id": f"classify-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": _usage(sum(map(_tokens, texts))),
    }


def pooling(raw: bytes, model: str, dim: int = 8) -> dict[str, Any]:
    body = _body(raw)
    texts = (
        [render_chat(body["messages"])]
        if "messages" in body
        else _texts(body.get("input"), "input")
    )
    data = []
    for i, text in enumerate(texts):
        rng = random.Random(xxhash.xxh64_intdigest(text.encode()))
        data.append(
            {"index": i, "object": "pooling", "data": [rng.gauss(0, 1) for _ in range(dim)]}
        )
    return {
        "id": f"pool-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": _usage(sum(map(_tokens, texts))),
    }


def multipart_parts(raw: bytes, content_type: str) -> Mapping[str, bytes]:
    """The parts of a multipart/form-data body by field name (the sim may buffer)."""
    boundary = next(
        (p.split("=", 1)[1].strip('"') for p in content_type.split(";") if "boundary=" in p), None
    )
    if not content_type.startswith("multipart/form-data") or not boundary:
        raise WireError(400, "expected a multipart/form-data body")
    parts: dict[str, bytes] = {}
    for chunk in raw.split(b"--" + boundary.encode())[1:]:
        if chunk.startswith(b"--"):
            break
        head, _, value = chunk.partition(b"\r\n\r\n")
        for line in head.decode("latin-1").split("\r\n"):
            if line.lower().startswith("content-disposition") and 'name="' in line:
                name = line.split('name="', 1)[1].split('"', 1)[0]
                parts[name] = value.removesuffix(b"\r\n")
    return parts


def transcription_stream(body: Mapping[str, Any], model: str) -> bytes:
    """A transcript as vLLM streams it (`stream=true`): one `transcription.chunk` per word,
    the last with its finish reason and usage, then `[DONE]`."""
    rid, created = f"trsc-{uuid.uuid4().hex}", int(time.time())
    words = str(body["text"]).split(" ")
    events = []
    for i, word in enumerate(words):
        last = i == len(words) - 1
        chunk: dict[str, Any] = {
            "id": rid,
            "object": "transcription.chunk",
            "created": created,
            "model": model,
            "choices": [
                {
                    "delta": {"content": word if i == 0 else " " + word},
                    "finish_reason": "stop" if last else None,
                    "stop_reason": None,
                }
            ],
        }
        if last:
            chunk["usage"] = body["usage"]
        events.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
    return b"".join(events) + b"data: [DONE]\n\n"


def transcription(
    raw: bytes, content_type: str, model: str
) -> tuple[dict[str, Any], str, int, bool]:
    """(body, sha256 of the audio file, its size, whether it is to be streamed): the engine
    keeps the checksum for tests."""
    parts = multipart_parts(raw, content_type)
    audio = parts.get("file")
    if audio is None:
        raise WireError(400, "the form has no 'file' field", "file")
    name = parts.get("model", b"").decode()
    if name and name != model:
        raise WireError(404, f"The model `{name}` does not exist.", "model")
    digest = hashlib.sha256(audio).hexdigest()
    seconds = max(1, len(audio) // 32000)
    return (
        {
            "text": f"simulated transcript of {len(audio)} bytes",
            "usage": {"type": "duration", "seconds": seconds},
        },
        digest,
        len(audio),
        parts.get("stream", b"").strip().lower() == b"true",
    )
