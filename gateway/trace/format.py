"""The kvgate trace format, and readers/writers for the public formats it converts.

kvgate trace (JSONL, one object per line)::

    {"kvgate_trace": 1, "block_tokens": 64, "tokenizer": "approx-4cpt", "salt_id": "1f2e3d4c",
     "source": "capture"}
    {"arrival_s": 0.0, "input_tokens": 150, "output_tokens": 20, "session_id": "9a0c...",
     "block_hashes": [1234, 5678, 9012], "last_block_tokens": 22}

* Line 1 is the header: tokens per block, the tokenizer's name, and an id of the salt the
  hashes were keyed with (a fingerprint, never the salt itself); optionally `epoch_s`, the
  Unix time of arrival_s 0 (the gateway's own capture appends across restarts with it).
* Every other line is one request (readers sort them by arrival). `arrival_s` is seconds since the
  first request; `session_id` is optional (already pseudonymised at capture).
* `block_hashes` are chained hashes of the prompt's fixed-size token blocks: hash i covers
  tokens 0 .. end of block i, so equal leading hashes mean an equal prompt prefix. All
  blocks are `block_tokens` long except the last, whose length is `last_block_tokens`, so
  `input_tokens == (len(block_hashes) - 1) * block_tokens + last_block_tokens`. A trace
  without prefix information (Azure) has no hashes and `last_block_tokens == 0`.

Also read: Mooncake JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids` of
512-token blocks, ceil(input/512) ids), also written; and the Azure LLM inference CSV
(`TIMESTAMP,ContextTokens,GeneratedTokens`: arrivals and lengths only).
"""

from __future__ import annotations

import csv
import hashlib
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

import orjson
import xxhash

from gateway.errors import ConfigError
from gateway.trace.tokenize import APPROX_TOKENIZER_NAME

FORMAT_VERSION = 1
DEFAULT_BLOCK_TOKENS = 64
MOONCAKE_BLOCK_TOKENS = 512
_U64 = (1 << 64) - 1
_MAX_RECHUNK_CACHE = 200_000


class TraceFormatError(ConfigError):
    """A trace file that cannot be read; the message names the file and line."""

    code = "invalid_trace"


@dataclass(frozen=True, slots=True)
class TraceHeader:
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    tokenizer: str = APPROX_TOKENIZER_NAME
    salt_id: str | None = None
    source: str = "kvgate"
    # Wall-clock time (Unix seconds) of arrival_s == 0, when the capture knows it.
    epoch_s: float | None = None


@dataclass(frozen=True, slots=True)
class TraceRecord:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...] = ()
    last_block_tokens: int = 0
    session_id: str | None = None
    # Captured live (gateway.forecast): cached prompt tokens the router expected on the
    # chosen replica, the most any replica held, and what the engine reported.
    predicted_cached: int | None = None
    best_cached: int | None = None
    achieved_cached: int | None = None
    # Tiered models (gateway.tiers): the tier the attempt ran on, why (e.g. "rule:0",
    # "escalated:length") and the classifier's score. Never any text.
    tier: str | None = None
    tier_reason: str | None = None
    tier_score: float | None = None

    def block_lengths(self, block_tokens: int) -> list[int]:
        n = len(self.block_hashes)
        if n == 0:
            return []
        return [block_tokens] * (n - 1) + [self.last_block_tokens]


@dataclass(frozen=True, slots=True)
class Trace:
    header: TraceHeader
    records: tuple[TraceRecord, ...] = field(default_factory=tuple)

    @property
    def block_tokens(self) -> int:
        return self.header.block_tokens

    def window(self, start: int = 0, count: int | None = None) -> Trace:
        """A slice of the trace with arrivals re-based to its first request."""
        chosen = self.records[start : None if count is None else start + count]
        if not chosen:
            return Trace(self.header, ())
        t0 = chosen[0].arrival_s
        # Every other field (forecasts, tiers) kept as recorded.
        rebased = tuple(replace(r, arrival_s=r.arrival_s - t0) for r in chosen)
        return Trace(self.header, rebased)


def last_block_len(input_tokens: int, n_blocks: int, block_tokens: int) -> int:
    return input_tokens - (n_blocks - 1) * block_tokens if n_blocks else 0


def _check_record(rec: TraceRecord, block_tokens: int, where: str) -> None:
    if rec.input_tokens < 0 or rec.output_tokens < 0:
        raise TraceFormatError(f"{where}: negative token count")
    if not rec.block_hashes:
        return
    if not 0 < rec.last_block_tokens <= block_tokens:
        raise TraceFormatError(
            f"{where}: last_block_tokens {rec.last_block_tokens} outside 1..{block_tokens}"
        )
    expect = (len(rec.block_hashes) - 1) * block_tokens + rec.last_block_tokens
    if expect != rec.input_tokens:
        raise TraceFormatError(
            f"{where}: {len(rec.block_hashes)} blocks of {block_tokens} tokens with a last"
            f" block of {rec.last_block_tokens} make {expect} tokens, not input_tokens"
            f" {rec.input_tokens}"
        )


# --- rechunking -------------------------------------------------------------------------


class Rechunker:
    """Maps chained block hashes of one block size onto another, deterministically.

    New block k covers tokens [k*to, min((k+1)*to, n)). Its hash is derived from the old
    chained hash of the block holding its last token (which identifies the whole prefix up
    to there) and k. Equal old prefixes therefore give equal new prefixes; a coarse trace
    block says only "all of its sub-blocks match or none do". Derived hashes are cached per
    old block, which makes re-chunking a whole trace a few dictionary look-ups per block.
    """

    def __init__(self, from_block: int, to_block: int) -> None:
        if from_block <= 0 or to_block <= 0:
            raise ValueError("block sizes must be positive")
        self.from_block = from_block
        self.to_block = to_block
        self._cache: dict[tuple[int, int], tuple[int, ...]] = {}

    def _derive(self, src: int, k: int) -> int:
        return xxhash.xxh3_64_intdigest(struct.pack("<QQ", src & _U64, k))

    def __call__(self, hashes: Sequence[int], input_tokens: int) -> tuple[int, ...]:
        if self.from_block == self.to_block or not hashes:
            return tuple(hashes)
        fb, tb = self.from_block, self.to_block
        n_new = -(-input_tokens // tb)
        if fb % tb == 0:
            ratio = fb // tb
            out: list[int] = []
            for i, src in enumerate(hashes):
                subs = self._cache.get((src, i))
                if subs is None:
                    # All sub-block hashes of one trace block from one XOF call.
                    seed = struct.pack("<QQ", src & _U64, i)
                    subs = struct.unpack(f"<{ratio}Q", hashlib.shake_128(seed).digest(8 * ratio))
                    if len(self._cache) >= _MAX_RECHUNK_CACHE:
                        self._cache.clear()
                    self._cache[(src, i)] = subs
                out.extend(subs)
            return tuple(out[:n_new])
        last = len(hashes) - 1
        return tuple(
            self._derive(hashes[min(last, (min((k + 1) * tb, input_tokens) - 1) // fb)], k)
            for k in range(n_new)
        )


# --- kvgate JSONL -----------------------------------------------------------------------


def header_line(header: TraceHeader) -> bytes:
    obj: dict[str, Any] = {
        "kvgate_trace": FORMAT_VERSION,
        "block_tokens": header.block_tokens,
        "tokenizer": header.tokenizer,
        "salt_id": header.salt_id,
        "source": header.source,
    }
    if header.epoch_s is not None:
        obj["epoch_s"] = header.epoch_s
    return orjson.dumps(obj) + b"\n"


def record_line(rec: TraceRecord) -> bytes:
    obj: dict[str, Any] = {
        "arrival_s": round(rec.arrival_s, 6),
        "input_tokens": rec.input_tokens,
        "output_tokens": rec.output_tokens,
    }
    if rec.session_id is not None:
        obj["session_id"] = rec.session_id
    obj["block_hashes"] = list(rec.block_hashes)
    obj["last_block_tokens"] = rec.last_block_tokens
    for name in _FORECAST:
        value = getattr(rec, name)
        if value is not None:
            obj[name] = value
    if rec.tier is not None:
        obj["tier"] = rec.tier
        obj["tier_reason"] = rec.tier_reason
        if rec.tier_score is not None:
            obj["tier_score"] = round(rec.tier_score, 4)
    return orjson.dumps(obj) + b"\n"


_FORECAST = ("predicted_cached", "best_cached", "achieved_cached")


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def write_trace(path: str | Path, trace: Trace) -> None:
    with open(path, "wb") as fh:
        fh.write(header_line(trace.header))
        fh.writelines(record_line(rec) for rec in trace.records)


def _parse_header(obj: dict[str, Any], where: str) -> TraceHeader:
    if obj.get("kvgate_trace") != FORMAT_VERSION:
        raise TraceFormatError(
            f"{where}: unsupported kvgate_trace version {obj.get('kvgate_trace')!r}"
        )
    block = obj.get("block_tokens", DEFAULT_BLOCK_TOKENS)
    if not isinstance(block, int) or block <= 0:
        raise TraceFormatError(f"{where}: block_tokens must be a positive integer")
    return TraceHeader(
        block_tokens=block,
        tokenizer=str(obj.get("tokenizer", APPROX_TOKENIZER_NAME)),
        salt_id=obj.get("salt_id"),
        source=str(obj.get("source", "kvgate")),
        epoch_s=None if obj.get("epoch_s") is None else float(obj["epoch_s"]),
    )


def _parse_record(obj: dict[str, Any], block_tokens: int, where: str) -> TraceRecord:
    try:
        hashes = tuple(int(h) for h in obj.get("block_hashes", ()))
        session = obj.get("session_id")
        rec = TraceRecord(
            arrival_s=float(obj["arrival_s"]),
            input_tokens=int(obj["input_tokens"]),
            output_tokens=int(obj["output_tokens"]),
            block_hashes=hashes,
            last_block_tokens=int(obj.get("last_block_tokens", 0)),
            session_id=None if session is None else str(session),
            predicted_cached=_opt_int(obj.get("predicted_cached")),
            best_cached=_opt_int(obj.get("best_cached")),
            achieved_cached=_opt_int(obj.get("achieved_cached")),
            tier=None if obj.get("tier") is None else str(obj["tier"]),
            tier_reason=None if obj.get("tier_reason") is None else str(obj["tier_reason"]),
            tier_score=None if obj.get("tier_score") is None else float(obj["tier_score"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceFormatError(f"{where}: bad record ({exc!r})") from exc
    _check_record(rec, block_tokens, where)
    return rec


def _json_lines(fh: Iterable[bytes], name: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for lineno, raw in enumerate(fh, 1):
        if not raw.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise TraceFormatError(f"{where}: not JSON ({exc})") from exc
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{where}: expected a JSON object")
        yield where, obj


def parse_kvgate(lines: Iterable[bytes], name: str = "<trace>") -> Trace:
    header: TraceHeader | None = None
    records: list[TraceRecord] = []
    for where, obj in _json_lines(lines, name):
        if header is None:
            header = _parse_header(obj, where)
        else:
            records.append(_parse_record(obj, header.block_tokens, where))
    if header is None:
        raise TraceFormatError(f"{name}: empty trace (no header line)")
    # The gateway's capture writes requests as they finish; readers get arrival order.
    records.sort(key=lambda r: r.arrival_s)
    return Trace(header, tuple(records))


# --- Mooncake JSONL ---------------------------------------------------------------------


def parse_mooncake(lines: Iterable[bytes], name: str = "<mooncake>") -> Trace:
    block = MOONCAKE_BLOCK_TOKENS
    records: list[TraceRecord] = []
    for where, obj in _json_lines(lines, name):
        try:
            inp = int(obj["input_length"])
            ids = tuple(int(h) for h in obj.get("hash_ids", ()))
            rec = TraceRecord(
                arrival_s=float(obj["timestamp"]) / 1000.0,
                input_tokens=inp,
                output_tokens=int(obj["output_length"]),
                block_hashes=ids,
                last_block_tokens=last_block_len(inp, len(ids), block),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"{where}: bad Mooncake record ({exc!r})") from exc
        if ids and len(ids) != -(-inp // block):
            raise TraceFormatError(
                f"{where}: {len(ids)} hash_ids for input_length {inp}; Mooncake has"
                f" ceil(input_length/{block}) = {-(-inp // block)}"
            )
        _check_record(rec, block, where)
        records.append(rec)
    t0 = records[0].arrival_s if records else 0.0
    if t0:
        records = [_rebase(r, t0) for r in records]
    header = TraceHeader(block_tokens=block, tokenizer="unknown", salt_id=None, source="mooncake")
    return Trace(header, tuple(records))


def _rebase(rec: TraceRecord, t0: float) -> TraceRecord:
    return TraceRecord(
        rec.arrival_s - t0,
        rec.input_tokens,
        rec.output_tokens,
        rec.block_hashes,
        rec.last_block_tokens,
        rec.session_id,
    )


def mooncake_lines(trace: Trace) -> Iterator[bytes]:
    """Mooncake lines; hashes re-chunked to 512 tokens and remapped to 0, 1, 2, ...

    Remapping in order of first appearance keeps the prefix structure and drops the
    original 64-bit values, as the published Mooncake traces do.
    """
    rechunk = Rechunker(trace.block_tokens, MOONCAKE_BLOCK_TOKENS)
    remap: dict[int, int] = {}
    for rec in trace.records:
        ids = [remap.setdefault(h, len(remap)) for h in rechunk(rec.block_hashes, rec.input_tokens)]
        obj = {
            "timestamp": round(rec.arrival_s * 1000.0),
            "input_length": rec.input_tokens,
            "output_length": rec.output_tokens,
            "hash_ids": ids,
        }
        yield orjson.dumps(obj) + b"\n"


def write_mooncake(path: str | Path, trace: Trace) -> None:
    with open(path, "wb") as fh:
        fh.writelines(mooncake_lines(trace))


# --- Azure CSV --------------------------------------------------------------------------


def parse_azure(fh: TextIO, name: str = "<azure>") -> Trace:
    """Azure LLM inference CSV: arrivals and lengths only (no prefix information)."""
    reader = csv.DictReader(fh)
    need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
    if reader.fieldnames is None or not need <= set(reader.fieldnames):
        raise TraceFormatError(f"{name}: expected CSV columns {sorted(need)}")
    rows: list[tuple[datetime, int, int]] = []
    for lineno, row in enumerate(reader, 2):
        try:
            rows.append(
                (
                    datetime.fromisoformat(row["TIMESTAMP"].strip()),
                    int(row["ContextTokens"]),
                    int(row["GeneratedTokens"]),
                )
            )
        except (TypeError, ValueError) as exc:
            raise TraceFormatError(f"{name}:{lineno}: bad row ({exc})") from exc
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0] if rows else None
    records = tuple(
        TraceRecord(
            arrival_s=(ts - t0).total_seconds() if t0 else 0.0, input_tokens=i, output_tokens=o
        )
        for ts, i, o in rows
    )
    header = TraceHeader(block_tokens=MOONCAKE_BLOCK_TOKENS, tokenizer="unknown", source="azure")
    return Trace(header, records)


# --- any format -------------------------------------------------------------------------


def read_trace(path: str | Path) -> Trace:
    """Read a kvgate, Mooncake or Azure trace, detected from its content."""
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            first = fh.readline()
            while first and not first.strip():
                first = fh.readline()
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace {p}: {exc.strerror}") from exc
    if first.lstrip().startswith(b"{"):
        with open(p, "rb") as fh:
            if b'"kvgate_trace"' in first:
                return parse_kvgate(fh, str(p))
            return parse_mooncake(fh, str(p))
    try:
        with open(p, newline="", encoding="utf-8") as tf:
            return parse_azure(tf, str(p))
    except UnicodeDecodeError as exc:
        raise TraceFormatError(
            f"{p}: neither JSON lines (kvgate, Mooncake) nor an Azure CSV: {exc.reason}"
            f" at byte {exc.start}"
        ) from exc
