"""The gateway's own keys for token blocks: one chained hash per full block of token ids.

Engine block hashes depend on the engine's hash function and seed (vLLM's is random per
process unless PYTHONHASHSEED is set), so the index never compares them with anything: it
re-keys every stored block from the token ids the event carries, and a prompt is keyed the
same way from its own token ids. Equal keys mean equal tokens from the start of the prompt
(and the same adapter and extra hash inputs).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import xxhash

if TYPE_CHECKING:
    from gateway.kvevents.wire import BlockStored

_xxh3 = xxhash.xxh3_64_intdigest
ROOT_SEED = 0x6B76_6B76  # separates these keys from the gateway's byte-stream hashes


def root_seed(lora_id: int | None = None) -> int:
    """Seed of a chain's first block: blocks of different adapters never share keys."""
    return (
        ROOT_SEED if lora_id is None else _xxh3(lora_id.to_bytes(8, "big", signed=True), ROOT_SEED)
    )


def namespace(lora_name: str | None, cache_salt: str | None, lora_id: int | None = None) -> int:
    """Seed of the namespace an adapter and/or a cache salt put blocks in (the engine
    hashes them apart from plain prompt blocks, so their keys must never equal those)."""
    return _xxh3(msgspec.msgpack.encode([lora_name, cache_salt, lora_id]), ROOT_SEED)


def block_namespace(event: BlockStored) -> int:
    """The namespace of a stored block under an adapter and/or a salt. The adapter is known
    by its name, as a request names it (vLLM's `lora_id` is a number the engine gave it
    when it loaded it, which no request can know; SGLang sends none): the id only names the
    namespace of an event that gives no name."""
    lora_id = event.lora_id if event.lora_name is None else None
    return namespace(event.lora_name, event.cache_salt, lora_id)


def in_namespace(keys: Sequence[int], ns: int) -> list[int]:
    """Plain chain keys moved into namespace `ns` (each stays a function of its chain)."""
    return [_xxh3(k.to_bytes(8, "little"), ns) for k in keys]


def _token_bytes(ids: Sequence[int]) -> bytes:
    try:
        return array("I", ids).tobytes()
    except OverflowError:
        return array("q", ids).tobytes()


def chain_keys(
    token_ids: Sequence[int],
    block_size: int,
    seed: int,
    extra_keys: Sequence[Any] | None = None,
    packed: bytes | None = None,
) -> list[int]:
    """Keys of the full blocks of `token_ids`, block i chained on block i-1 (first on `seed`).

    A block with extra hash inputs (`extra_keys[i]` not None: images, cache salt) mixes
    them in, so it never matches a prompt keyed from plain tokens: the index under-counts
    such blocks rather than claiming a hit the engine would not give. `packed`: the ids as
    4-byte integers already (`array("I", token_ids).tobytes()`).
    """
    n = len(token_ids) // block_size
    if n == 0:
        return []
    if packed is not None and len(packed) == 4 * len(token_ids):
        data = memoryview(packed)[: 4 * n * block_size]
    else:
        data = memoryview(_token_bytes(token_ids[: n * block_size]))
    step = len(data) // n
    out: list[int] = []
    append = out.append
    h = seed
    if not extra_keys or all(x is None for x in extra_keys):
        # The usual event: plain tokens. Positional seed (keywords cost as much as hashing).
        for start in range(0, n * step, step):
            h = _xxh3(data[start : start + step], h)
            append(h)
        return out
    for i in range(n):
        h = _xxh3(data[i * step : (i + 1) * step], h)
        if i < len(extra_keys) and extra_keys[i] is not None:
            h = _xxh3(msgspec.msgpack.encode(extra_keys[i]), h)
        append(h)
    return out
