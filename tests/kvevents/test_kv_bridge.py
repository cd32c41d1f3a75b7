"""Prompt hashes -> token blocks: what the simulated engine stores is what the gateway
looks up, for every block the canonical bytes determine."""

from __future__ import annotations

from array import array

from gateway.keys import route_request
from gateway.kvevents.bridge import PromptBridge
from gateway.kvevents.learn import learn_prompt
from gateway.kvevents.render import SimRenderer, TokenIdsOnly
from gateway.kvevents.tokenkeys import chain_keys, root_seed
from gateway.sim.tokenizer import approx_token_ids, render_chat
from gateway.types import Endpoint

BLOCK_TOKENS = 16  # prompt hash blocks of 64 bytes


def chat(*texts: str) -> dict[str, object]:
    roles = ["system"] + ["user", "assistant"] * len(texts)
    return {"model": "m", "messages": [{"role": r, "content": t} for r, t in zip(roles, texts)]}


def learn(
    body: dict[str, object], endpoint: Endpoint = Endpoint.CHAT
) -> tuple[tuple[int, ...], array[int], list[int]]:
    request = route_request(body, endpoint, "r", block_tokens=BLOCK_TOKENS, max_prefix_blocks=4096)
    learnt = learn_prompt(
        SimRenderer(), body, endpoint, request.prefix_hashes, BLOCK_TOKENS * 4, 16
    )
    assert learnt is not None
    return learnt


def test_every_mapped_block_is_a_block_the_engine_stores() -> None:
    body = chat("Be brief. " * 30, "Tell me about caches. " * 20, "Sure. " * 10, "More! " * 10)
    _hashes, keys, counts = learn(body)
    engine_ids = approx_token_ids(render_chat(body["messages"]))  # type: ignore[arg-type]
    engine_keys = chain_keys(engine_ids, 16, root_seed())
    assert list(keys) == engine_keys
    assert counts == sorted(counts) and counts[-1] > 0
    # A block boundary of the canonical stream never claims more than the prefix fixes.
    for j, n in enumerate(counts):
        assert n * 16 * 4 <= (j + 1) * BLOCK_TOKENS * 4 + 64


def test_a_later_turn_finds_the_previous_turns_blocks_without_tokenizing() -> None:
    first = chat("Be brief. " * 30, "Tell me about caches. " * 20)
    hashes, keys, counts = learn(first)
    bridge = PromptBridge()
    bridge.learn(hashes, keys, counts)
    later = chat("Be brief. " * 30, "Tell me about caches. " * 20, "Sure. " * 40, "Why? " * 30)
    request = route_request(
        later, Endpoint.CHAT, "r2", block_tokens=BLOCK_TOKENS, max_prefix_blocks=4096
    )
    found = bridge.lookup(request.prefix_hashes)
    assert found is not None
    got, n = found
    full = chain_keys(approx_token_ids(render_chat(later["messages"])), 16, root_seed())  # type: ignore[arg-type]
    assert n >= counts[-1] - 1 and list(got[:n]) == full[:n]
    assert (
        bridge.lookup(
            route_request(
                chat("Other. " * 40, "x " * 90),
                Endpoint.CHAT,
                "r3",
                block_tokens=BLOCK_TOKENS,
                max_prefix_blocks=4096,
            ).prefix_hashes
        )
        is None
    )


def test_completions_text_and_token_ids() -> None:
    text = "once upon a time " * 40
    _, keys, _counts = learn({"model": "m", "prompt": text}, Endpoint.COMPLETIONS)
    assert list(keys) == chain_keys(approx_token_ids(text), 16, root_seed())
    ids = list(range(500, 900))
    rendered = TokenIdsOnly().render({"prompt": ids}, Endpoint.COMPLETIONS)
    assert rendered is not None and rendered.stable_tokens(64) == 16
    assert rendered.stable_tokens(10_000) == 400


def test_bridge_is_bounded() -> None:
    bridge = PromptBridge(max_entries=2)
    bridge.learn((1, 2, 3), array("Q", [9, 8, 7]), [1, 2, 3])
    assert not bridge.knows(1) and bridge.knows(3)
    assert bridge.lookup((1, 2, 3, 4)) == (array("Q", [9, 8, 7]), 3)


def test_known_blocks_is_the_longest_learnt_leading_part() -> None:
    bridge = PromptBridge()
    bridge.learn([1, 2, 3], array("Q", [7, 8, 9]), [1, 2, 3])
    assert bridge.known_blocks([1, 2, 3]) == 3
    assert bridge.known_blocks([1, 2, 3, 40, 41]) == 3  # the next turn adds two blocks
    assert bridge.known_blocks([1, 2, 5, 6]) == 2  # a branch after the second block
    long = [1, 2, 3, *range(100, 140)]  # past the linear probes: the binary search
    assert bridge.known_blocks(long) == 3
    assert bridge.known_blocks([50, 51]) == 0
    assert bridge.known_blocks([]) == 0
