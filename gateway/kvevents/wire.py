"""Decoding (and, for the simulator and tests, encoding) of engine KV cache event batches.

A publisher (vLLM's `--kv-events-config`, SGLang's equivalent) sends ZMQ multipart
messages ``[topic, seq (8 bytes, big-endian), payload]``; the payload is one msgpack
`EventBatch`. Engines and versions differ in layout only:

* the batch is a positional array ``[ts, events, dp_rank?]`` or a map with ``ts``,
  ``events`` and ``data_parallel_rank`` / ``attn_dp_rank``;
* each event is a tagged array ``["BlockStored", field, ...]`` or a map whose ``type`` is
  the tag; trailing optional fields may be absent (older versions, ``omit_defaults``);
* block hashes are integers or bytes (sha256-based hashing), kept as they come;
* SGLang under EAGLE speculative decoding publishes `token_ids` as pairs
  ``[[t0, t1], [t1, t2], ...]`` (its radix keys are bigrams): the first of each pair is the
  token the page holds, so the pairs are keyed as those tokens.

Namespaces: vLLM lists the adapter name first in every block's `extra_keys` (and the
cache salt in the first block's); SGLang sends `cache_salt` and `lora_name` as fields.
Both end up in `BlockStored.lora_name` / `cache_salt` (the adapter name is taken out of
vLLM's extra keys, which keep the rest), so the index can key such blocks apart.

So the decoder reads msgpack generically and picks fields by position or name, which
accepts every layout above and ignores fields it does not know.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

BlockHash = int | bytes
GPU = "GPU"

# Field order of the positional layouts (BlockStored's 4th was `num_toks_per_block` in the
# oldest versions: same position, same meaning).
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class WireError(ValueError):
    """A payload that is not an event batch this module understands."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    # Per block: what besides the tokens entered the engine's hash (images, cache salt...).
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    # Adapter and cache salt the engine hashed the blocks under (None: plain prompt blocks).
    lora_name: str | None = None
    cache_salt: str | None = None
    # vLLM: the attention kind of the KV cache group (hybrid models publish several).
    spec_kind: str | None = None
    # `token_ids` as 4-byte integers, when the decoder already packed them (the intake
    # thread, so that keying them on the event loop does not convert them again).
    packed: bytes | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None = None


_HASH_TYPES = frozenset((int, bytes))


def _hashes(value: Any) -> tuple[BlockHash, ...]:
    # The check in C (a generator over a 20K-token prompt's 1250 hashes took 0.1 ms).
    if not isinstance(value, list) or not _HASH_TYPES.issuperset(map(type, value)):
        raise WireError("block_hashes must be a list of integers or bytes")
    return tuple(value)


def _fields(raw: Any, names: Sequence[str], tag: str) -> dict[str, Any]:
    if isinstance(raw, list):
        return dict(zip(names, raw[1:], strict=False))
    fields = {k: v for k, v in raw.items() if isinstance(k, str)}
    if tag == "BlockStored" and "block_size" not in fields and "num_toks_per_block" in fields:
        fields["block_size"] = fields["num_toks_per_block"]
    return fields


def _opt_int(value: Any, name: str) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise WireError(f"{name} must be an integer or null")


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _first_of_pairs(tokens: list[Any]) -> list[Any]:
    if not all(isinstance(p, list) and len(p) == 2 for p in tokens):
        raise WireError("token_ids must be a list of integers or of integer pairs")
    return [p[0] for p in tokens]


def _without_adapter(extra: list[Any], name: str) -> list[Any] | None:
    """vLLM's per-block extra keys with the adapter name (listed first) taken out."""
    out: list[Any] = []
    for keys in extra:
        if isinstance(keys, list) and keys and keys[0] == name:
            keys = keys[1:] or None
        out.append(keys)
    return out if any(k is not None for k in out) else None


def _event(raw: Any) -> Event:
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        tag = raw["type"]
    else:
        raise WireError("an event must be a tagged array or a map with a 'type'")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if tag == "BlockRemoved":
        f = _fields(raw, _REMOVED_FIELDS, tag)
        medium = f.get("medium")
        return BlockRemoved(
            _hashes(f.get("block_hashes")),
            medium if isinstance(medium, str) else None,
            _opt_int(f.get("group_idx"), "group_idx"),
        )
    if tag == "BlockStored":
        f = _fields(raw, _STORED_FIELDS, tag)
        tokens = f.get("token_ids")
        if not isinstance(tokens, list):
            raise WireError("token_ids must be a list of integers")
        if tokens and isinstance(tokens[0], list):
            tokens = _first_of_pairs(tokens)
        # Packing checks every id in C (a generator over 20K ids took a millisecond).
        packed: bytes | None = None
        try:
            packed = array("I", tokens).tobytes()
        except OverflowError:  # ids of 2^32 and over (or negative): keyed as 8 bytes
            if not all(isinstance(t, int) for t in tokens):
                raise WireError("token_ids must be a list of integers") from None
        except TypeError:
            raise WireError("token_ids must be a list of integers") from None
        size = f.get("block_size")
        if not isinstance(size, int) or size <= 0:
            raise WireError("block_size must be a positive integer")
        parent = f.get("parent_block_hash")
        if parent is not None and not isinstance(parent, int | bytes):
            raise WireError("parent_block_hash must be an integer, bytes or null")
        extra = f.get("extra_keys")
        medium = f.get("medium")
        lora_name = _opt_str(f.get("lora_name"))
        if lora_name is not None and isinstance(extra, list):
            extra = _without_adapter(extra, lora_name)
        return BlockStored(
            _hashes(f.get("block_hashes")),
            parent,
            tuple(tokens),
            size,
            _opt_int(f.get("lora_id"), "lora_id"),
            medium if isinstance(medium, str) else None,
            tuple(extra) if isinstance(extra, list) else None,
            _opt_int(f.get("group_idx"), "group_idx"),
            lora_name,
            _opt_str(f.get("cache_salt")),
            _opt_str(f.get("kv_cache_spec_kind")),
            packed,
        )
    raise WireError(f"unknown event type {tag!r}")


def decode_batch(payload: bytes) -> EventBatch:
    """One msgpack `EventBatch`, any layout (see the module docstring)."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"not msgpack: {exc}") from None
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        ts, events = raw.get("ts"), raw.get("events")
        rank = raw.get("data_parallel_rank", raw.get("attn_dp_rank"))
    else:
        raise WireError("an event batch must be an array or a map")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise WireError("an event batch needs a numeric ts and a list of events")
    return EventBatch(float(ts), tuple(_event(e) for e in events), _opt_int(rank, "dp_rank"))


def decode_seq(frame: bytes) -> int:
    """The sequence number frame: 8 bytes, big-endian (signed: replay ends with -1)."""
    if len(frame) != 8:
        raise WireError("a sequence number is 8 bytes")
    return int.from_bytes(frame, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


# ---- encoding, as the engines do it (for the simulated engine and wire tests) -------------

Layout = Literal["array", "map", "mixed"]


class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _ArrayStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _ArrayRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None


class _ArrayCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class _MapStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    cache_salt: str | None = None
    kv_cache_spec_kind: str | None = None


class _MapRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class _MapCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


class _ArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _MapBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _to_struct(event: Event, positional: bool) -> Any:
    if isinstance(event, BlockStored):
        if positional:
            return _ArrayStored(
                list(event.block_hashes),
                event.parent_block_hash,
                list(event.token_ids),
                event.block_size,
                event.lora_id,
                event.medium,
            )
        return _MapStored(
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            event.medium,
            lora_name=event.lora_name,
            extra_keys=list(event.extra_keys) if event.extra_keys is not None else None,
            group_idx=event.group_idx,
            cache_salt=event.cache_salt,
            kv_cache_spec_kind=event.spec_kind,
        )
    if isinstance(event, BlockRemoved):
        if positional:
            return _ArrayRemoved(list(event.block_hashes), event.medium)
        return _MapRemoved(list(event.block_hashes), event.medium, event.group_idx)
    return _ArrayCleared() if positional else _MapCleared()


_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(batch: EventBatch, layout: Layout = "array") -> bytes:
    """Encode as an engine does: ``array`` (vLLM up to 0.11, SGLang's older publisher),
    ``map`` (vLLM's current one: batch and events as maps) or ``mixed`` (a positional
    batch of map events, as SGLang's current publisher)."""
    events = [_to_struct(e, layout == "array") for e in batch.events]
    if layout == "map":
        return _ENCODER.encode(_MapBatch(batch.ts, events, batch.dp_rank))
    return _ENCODER.encode(_ArrayBatch(batch.ts, events, batch.dp_rank))
