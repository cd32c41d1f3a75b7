"""Payloads encoded exactly as the engines' own msgspec classes encode them decode to the
same events, whatever the layout and version; anything else is a WireError."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest

from gateway.kvevents.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireError,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)
from tests.kvevents.engine_fixtures import all_scenarios

# The engines' event classes, written from their documented field lists (not copied):
# vLLM <= 0.10 (positional, no medium), vLLM 0.11 (positional, medium), vLLM main (maps,
# more optional fields), SGLang (positional batch with attn_dp_rank, map events).


class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class OldRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[int]


class OldCleared(OldEvent, tag="AllBlocksCleared"):
    pass


class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class MidStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class MidRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class MidBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class NewEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class NewStored(NewEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class NewRemoved(NewEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class NewCleared(NewEvent, tag="AllBlocksCleared"):
    pass


class NewBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class SglBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


TOKENS = list(range(100, 132))
enc = msgspec.msgpack.encode


def test_vllm_positional_without_medium() -> None:
    payload = enc(
        OldBatch(
            1.5,
            [
                OldStored([11, 12], None, TOKENS, 16, None),
                OldRemoved([11]),
                OldCleared(),
            ],
        )
    )
    batch = decode_batch(payload)
    assert batch == EventBatch(
        1.5,
        (
            BlockStored((11, 12), None, tuple(TOKENS), 16, None, None),
            BlockRemoved((11,), None),
            AllBlocksCleared(),
        ),
    )


def test_vllm_positional_with_medium_bytes_hashes_and_rank() -> None:
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    payload = enc(
        MidBatch(
            2.0,
            [
                MidStored([h2], h1, TOKENS[:16], 16, 3, "CPU"),
                MidRemoved([h1], "GPU"),
            ],
            data_parallel_rank=1,
        )
    )
    batch = decode_batch(payload)
    assert batch.dp_rank == 1
    assert batch.events == (
        BlockStored((h2,), h1, tuple(TOKENS[:16]), 16, 3, "CPU"),
        BlockRemoved((h1,), "GPU"),
    )


def test_vllm_maps_with_fields_the_decoder_does_not_use() -> None:
    payload = enc(
        NewBatch(
            3.0,
            [
                NewStored(
                    [5, 6],
                    4,
                    TOKENS,
                    16,
                    None,
                    "GPU",
                    None,
                    extra_keys=[None, ("salt",)],
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                ),
                NewRemoved([5], "GPU", group_idx=1),
                NewCleared(),
            ],
        )
    )
    batch = decode_batch(payload)
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash == 4 and stored.extra_keys == (None, ["salt"])
    assert stored.group_idx == 0 and stored.medium == "GPU"
    assert removed == BlockRemoved((5,), "GPU", 1)
    assert cleared == AllBlocksCleared()


def test_sglang_positional_batch_of_map_events() -> None:
    payload = enc(
        SglBatch(4.0, [NewStored([7], None, TOKENS[:16], 16, None, "CPU_PINNED", None)], 2)
    )
    batch = decode_batch(payload)
    assert batch.dp_rank == 2
    assert batch.events == (BlockStored((7,), None, tuple(TOKENS[:16]), 16, None, "CPU_PINNED"),)


@pytest.mark.parametrize("layout", ["array", "map", "mixed"])
def test_own_encoder_round_trips_in_every_layout(layout: str) -> None:
    batch = EventBatch(
        5.0,
        (
            BlockStored((1, 2), None, tuple(TOKENS), 16, None, "GPU"),
            BlockRemoved((2,), "GPU"),
            AllBlocksCleared(),
        ),
    )
    assert decode_batch(encode_batch(batch, layout)) == batch  # type: ignore[arg-type]


def test_own_array_encoding_is_byte_identical_to_the_engine_class() -> None:
    ours = encode_batch(
        EventBatch(1.0, (BlockStored((1,), None, tuple(TOKENS[:16]), 16, None, "GPU"),))
    )
    theirs = enc(MidBatch(1.0, [MidStored([1], None, TOKENS[:16], 16, None, "GPU")]))
    assert ours == theirs


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        enc(42),
        enc([1.0]),
        enc(["x", []]),
        enc([1.0, [["Unknown", 1]]]),
        enc([1.0, [["BlockStored", "nope", None, [], 16, None]]]),
        enc([1.0, [["BlockStored", [1, "h"], None, [], 16, None]]]),
        enc([1.0, [["BlockRemoved", [1, True]]]]),
        enc([1.0, [["BlockRemoved", [1.5]]]]),
        enc([1.0, [["BlockStored", [1], None, [1, "a"], 16, None]]]),
        enc([1.0, [["BlockStored", [1], None, [1, 2.5], 16, None]]]),
        enc([1.0, [["BlockStored", [1], None, [2**40, "a"], 16, None]]]),
        enc([1.0, [["BlockStored", [1], None, [1], 0, None]]]),
        enc([1.0, [["BlockStored", [1], 1.5, [1], 16, None]]]),
        enc([1.0, [{"no_type": 1}]]),
    ],
)
def test_malformed_payloads_are_wire_errors(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(payload)


def test_sequence_frames() -> None:
    assert decode_seq((7).to_bytes(8, "big")) == 7
    assert decode_seq(encode_seq(-1)) == -1
    with pytest.raises(WireError):
        decode_seq(b"\x00")


def test_token_ids_are_packed_once_and_key_as_unpacked_ones() -> None:
    from array import array

    from gateway.kvevents.tokenkeys import chain_keys, root_seed

    small = list(range(100, 132))
    big = [2**33 + t for t in small]  # beyond 4 bytes: keyed as 8-byte ids, not packed
    for ids, packed in ((small, array("I", small).tobytes()), (big, None)):
        (event,) = decode_batch(enc([1.0, [["BlockStored", [1, 2], None, ids, 16, None]]])).events
        assert isinstance(event, BlockStored) and event.packed == packed
        assert event.token_ids == tuple(ids)
        assert chain_keys(ids, 16, root_seed(), None, event.packed) == chain_keys(
            ids, 16, root_seed()
        )


# --- the recorded engine payloads, whole, cut short and garbled ---------------------------


def _recorded_payloads() -> list[tuple[str, bytes]]:
    out = []
    for sc in all_scenarios():
        for i, frames in enumerate(sc.live):
            out.append((f"{sc.engine}:{sc.name}:{i}", frames[2]))
    return out


RECORDED = _recorded_payloads()


@pytest.mark.parametrize(("name", "payload"), RECORDED, ids=[n for n, _ in RECORDED])
def test_every_recorded_batch_decodes_and_survives_our_own_encoding(
    name: str, payload: bytes
) -> None:
    batch = decode_batch(payload)
    assert batch.events, name
    # The map layouts carry every field the decoder reads.
    for layout in ("map", "mixed"):
        assert decode_batch(encode_batch(batch, layout)) == batch  # type: ignore[arg-type]
    # The positional layout (vLLM <= 0.11) has no place for the later fields.
    old = decode_batch(encode_batch(batch, "array"))
    assert (old.ts, old.dp_rank, len(old.events)) == (batch.ts, batch.dp_rank, len(batch.events))
    for got, want in zip(old.events, batch.events, strict=True):
        assert type(got) is type(want)
        if isinstance(want, BlockStored):
            assert isinstance(got, BlockStored)
            keep = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium")
            assert [getattr(got, k) for k in keep] == [getattr(want, k) for k in keep]
        elif isinstance(want, BlockRemoved):
            assert isinstance(got, BlockRemoved)
            assert (got.block_hashes, got.medium) == (want.block_hashes, want.medium)


@pytest.mark.parametrize(("name", "payload"), RECORDED[::3], ids=[n for n, _ in RECORDED[::3]])
def test_a_recorded_batch_cut_short_is_a_wire_error_never_a_crash(
    name: str, payload: bytes
) -> None:
    whole = decode_batch(payload)
    for end in range(len(payload)):
        try:
            got = decode_batch(payload[:end])
        except WireError:
            continue
        # A cut that still parses is a shorter msgpack value: never the whole batch.
        assert got != whole, (name, end)


@pytest.mark.parametrize("seed", range(4))
def test_garbled_recorded_batches_decode_or_are_wire_errors(seed: int) -> None:
    rng = random.Random(seed)
    for _name, payload in RECORDED:
        raw = bytearray(payload)
        for _ in range(rng.randint(1, 3)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        try:
            batch = decode_batch(bytes(raw))
        except WireError:
            continue
        assert isinstance(batch, EventBatch)
        assert all(
            isinstance(e, BlockStored | BlockRemoved | AllBlocksCleared) for e in batch.events
        )


@pytest.mark.parametrize("frame", [b"", b"\x00" * 7, b"\x00" * 9])
def test_a_sequence_frame_of_the_wrong_size_is_a_wire_error(frame: bytes) -> None:
    with pytest.raises(WireError, match="8 bytes"):
        decode_seq(frame)


@pytest.mark.parametrize(
    ("event", "what"),
    [
        (["BlockRemoved", [1, 2], None, "one"], "group_idx"),
        (["BlockStored", [1], None, [[1, 2, 3]], 16], "integer pairs"),
        (["BlockStored", [1], None, [1, "x"], 16], "token_ids"),
        (["BlockStored", [1], None, [1, 2], 0], "block_size"),
        (["BlockStored", [1], "parent", [1, 2], 16], "parent_block_hash"),
        ({"type": "Nope"}, "unknown event type"),
        ([], "tagged array"),
        (["BlockRemoved", "not a list"], "block_hashes"),
    ],
)
def test_a_bad_field_is_named_in_the_wire_error(event: object, what: str) -> None:
    payload = msgspec.msgpack.encode([1.0, [event]])
    with pytest.raises(WireError, match=what):
        decode_batch(payload)
