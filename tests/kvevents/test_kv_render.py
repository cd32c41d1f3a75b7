"""A renderer's opening: the first token ids of a prompt from a small part of the work,
always equal to those of the whole prompt's tokenization (sim tokenizer, a byte-level BPE
trained here)."""

from __future__ import annotations

import random

import pytest

from gateway.kvevents.learn import learn_rendered, opening_key
from gateway.kvevents.render import OPENING_CHARS_PER_TOKEN, TokenIdsOnly
from gateway.types import Endpoint
from tests.kvevents.test_kv_incremental import bpe_path, conversations, renderers, text

__all__ = ["bpe_path"]  # the fixture, used by name


@pytest.mark.parametrize("kind", ["sim", "bpe"])
def test_the_opening_is_the_start_of_the_whole_tokenization(
    kind: str, request: pytest.FixtureRequest
) -> None:
    bpe = request.getfixturevalue("bpe_path") if kind == "bpe" else None
    renderer = renderers(kind, bpe, None)
    rng = random.Random(7)
    bodies: list[tuple[dict[str, object], Endpoint]] = []
    for seed in range(20):
        for layout in ("turns", "growing"):
            bodies += [({"messages": m}, Endpoint.CHAT) for m in conversations(seed, layout, 3)]
        # Completions, around the length where the opening is cut.
        n = rng.randint(1, 3 * 16 * OPENING_CHARS_PER_TOKEN // 5)
        bodies.append(({"prompt": text(rng, n)}, Endpoint.COMPLETIONS))
    bodies.append(({"prompt": list(range(100, 140))}, Endpoint.COMPLETIONS))
    answered = 0
    for body, endpoint in bodies:
        whole = renderer.render(body, endpoint)
        assert whole is not None
        opening = renderer.opening(body, endpoint, 16)
        if opening is None:
            # Only a prompt without a full block, or one whose cut it could not trust.
            assert len(whole.token_ids) < 16 + 2 or len(str(body)) > 16 * OPENING_CHARS_PER_TOKEN
            continue
        answered += 1
        assert list(opening) == list(whole.token_ids[:16])
        learnt = learn_rendered(whole, (1,), 64, 16)
        assert opening_key(opening, 16) == learnt[1][0]
    assert answered > len(bodies) * 0.9


def test_no_opening_without_a_full_block_or_a_renderer_for_the_endpoint() -> None:
    only_ids = TokenIdsOnly()
    assert only_ids.opening({"prompt": [1, 2, 3]}, Endpoint.COMPLETIONS, 16) is None
    assert only_ids.opening({"messages": []}, Endpoint.CHAT, 16) is None
    assert list(only_ids.opening({"prompt": list(range(20))}, Endpoint.COMPLETIONS, 16) or ()) == (
        list(range(16))
    )
    assert opening_key([1, 2, 3], 16) is None
