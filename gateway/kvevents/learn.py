"""What a tokenized prompt teaches the bridge: its prompt hashes, the keys of its token
blocks, and how many of those blocks each prompt block covers. Pure; runs in the tokenizer
stage's workers, threads or processes (gateway.kvevents.workers).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.kvevents.render import Rendered, Renderer
from gateway.kvevents.tokenkeys import chain_keys, root_seed
from gateway.types import Endpoint

Learnt = tuple[tuple[int, ...], "array[int]", list[int]]


def learn_prompt(
    renderer: Renderer,
    body: Mapping[str, Any],
    endpoint: Endpoint,
    prompt_hashes: Sequence[int],
    prompt_block_bytes: int,
    block_size: int,
) -> Learnt | None:
    """(prompt hashes, token-block keys, keys known at each prompt block): threadable."""
    rendered = renderer.render(body, endpoint)
    if rendered is None:
        return None
    return learn_rendered(rendered, prompt_hashes, prompt_block_bytes, block_size)


def learn_rendered(
    rendered: Rendered, prompt_hashes: Sequence[int], prompt_block_bytes: int, block_size: int
) -> Learnt:
    ids = rendered.token_ids
    if rendered.keys is not None:
        keys = array("Q", rendered.keys)
    else:
        keys = array("Q", chain_keys(ids, block_size, root_seed()))
    counts = [
        rendered.stable_tokens((j + 1) * prompt_block_bytes) // block_size
        for j in range(len(prompt_hashes))
    ]
    return tuple(prompt_hashes), keys, counts


def opening_key(opening: Sequence[int], block_size: int) -> int | None:
    """The key of a prompt's first token block (from its opening's ids), or None when the
    opening holds no full block. Keys chain: a replica without this block holds none of
    the prompt."""
    if len(opening) < block_size:
        return None
    return chain_keys(opening[:block_size], block_size, root_seed())[0]
