"""The lineage rule (gateway.lineage) on real request bodies, through gateway.keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.keys import route_request
from gateway.lineage import (
    SHARED,
    TAIL_BYTES_PER_HASH,
    Conversations,
    LineageIndex,
    LineageMatch,
    TailProbe,
)
from gateway.trace.format import read_trace
from gateway.trace.render import Layout, Renderer
from gateway.trace.replay import PromptBuilder, build_body
from gateway.trace.routing import route_request_for
from gateway.types import Endpoint, ReplicaId, ReplicaState, RouteRequest

PREAMBLE = "You are a coding agent. Tools: " + " ".join(f"tool{i}(x)" for i in range(400))
BT = 16  # small blocks, so short texts span many of them


def hashes(body: dict[str, Any], endpoint: Endpoint = Endpoint.CHAT) -> tuple[int, ...]:
    request = route_request(body, endpoint, "r", block_tokens=BT, max_prefix_blocks=4096)
    return request.lineage_hashes


def chat(*messages: tuple[str, str]) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}


def growing(turns: list[str]) -> dict[str, Any]:
    """The whole history in one user message, after a short system message."""
    return chat(("system", "Be an agent."), ("user", "\n".join(turns)))


def per_turn(turns: list[str]) -> dict[str, Any]:
    roles = ["user" if i % 2 == 0 else "assistant" for i in range(len(turns))]
    return chat(("system", PREAMBLE), *zip(roles, turns))


def turns_of(name: str, n: int) -> list[str]:
    return [f"{name} turn {i}: " + f"{name}{i} " * 40 for i in range(n)]


class Run:
    """Resolve, then record, as the proxy does; returns each request's session key."""

    def __init__(self, slack_tokens: int = 0) -> None:
        self.convs = Conversations(BT, slack_tokens=slack_tokens)

    def __call__(self, h: tuple[int, ...]) -> str:
        key = self.convs.key_for(h, None)
        assert key is not None
        self.convs.record(h, key)
        return key

    def request(self, body: dict[str, Any], endpoint: Endpoint = Endpoint.CHAT) -> RouteRequest:
        """Through `route_request`, keyed on its lineage; not recorded."""
        request = route_request(
            body,
            endpoint,
            "r",
            block_tokens=BT,
            max_prefix_blocks=4096,
            lineage=self.convs.key_for,
        )
        assert request.key_source == "lineage"
        return request

    def body(self, body: dict[str, Any], endpoint: Endpoint = Endpoint.CHAT) -> str:
        """Through `route_request`, with the conversation key of chat bodies."""
        request = self.request(body, endpoint)
        self.convs.record(request.lineage_hashes, request.session_key, request.lineage_tail)
        return request.session_key


def test_one_growing_user_message_keeps_one_lineage() -> None:
    run = Run()
    t = turns_of("a", 6)
    keys = {run(hashes(growing(t[: k + 1]))) for k in range(6)}
    assert len(keys) == 1


def test_one_message_per_turn_keeps_one_lineage() -> None:
    run = Run()
    t = turns_of("a", 7)
    keys = {run(hashes(per_turn(t[: k + 1]))) for k in (0, 2, 4, 6)}
    assert len(keys) == 1


def test_completions_and_token_ids_grow_alike() -> None:
    run = Run()
    text = PREAMBLE
    keys = set()
    for i in range(4):
        text += f" step {i} " + "x" * 300
        keys.add(run(hashes({"model": "m", "prompt": text}, Endpoint.COMPLETIONS)))
    assert len(keys) == 1
    ids = list(range(1, 200))
    id_keys = set()
    for i in range(4):
        ids += list(range(1000 + 100 * i, 1100 + 100 * i))
        id_keys.add(run(hashes({"model": "m", "prompt": list(ids)}, Endpoint.COMPLETIONS)))
    assert len(id_keys) == 1 and id_keys != keys


def test_tool_calls_and_results_extend_the_lineage() -> None:
    run = Run()
    base = [{"role": "system", "content": PREAMBLE}, {"role": "user", "content": "fix the bug"}]
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}
        ],
    }
    result = {"role": "tool", "tool_call_id": "c1", "content": "file text " * 50}
    k1 = run(hashes({"model": "m", "messages": base}))
    k2 = run(hashes({"model": "m", "messages": [*base, call, result]}))
    assert k1 == k2


def test_a_shared_preamble_never_defines_a_conversation() -> None:
    run = Run()
    a, b, c = turns_of("a", 5), turns_of("b", 5), turns_of("c", 5)
    ka = run(hashes(per_turn(a[:1])))
    kb = run(hashes(per_turn(b[:1])))
    kc = run(hashes(per_turn(c[:1])))
    assert len({ka, kb, kc}) == 3
    # Each goes on in its own lineage, whatever the order of their turns.
    assert run(hashes(per_turn(b[:3]))) == kb
    assert run(hashes(per_turn(a[:3]))) == ka
    assert run(hashes(per_turn(c[:5]))) == kc
    assert run(hashes(per_turn(a[:5]))) == ka


def test_identical_openers_part_when_one_moves_on() -> None:
    run = Run()
    hi = [("system", PREAMBLE), ("user", "hi")]
    first = run(hashes(chat(*hi)))
    assert run(hashes(chat(*hi))) == first  # the same prompt: nothing tells them apart yet
    a = run(hashes(chat(*hi, ("assistant", "Hello! " * 20), ("user", "plan a trip " * 10))))
    b = run(hashes(chat(*hi, ("assistant", "Hi there " * 20), ("user", "write a poem " * 10))))
    assert a == first
    assert b != first


def test_cut_or_summarised_history_becomes_a_new_lineage() -> None:
    run = Run()
    t = turns_of("a", 9)
    k = run(hashes(per_turn(t[:7])))
    summary = ["summary of the earlier turns " * 5, *t[6:9]]
    k2 = run(hashes(per_turn(summary)))
    assert k2 != k
    assert run(hashes(per_turn([*summary, "more " * 30, "go on " * 30]))) == k2


def test_no_prefix_hashes_means_no_lineage() -> None:
    assert Conversations(BT).key_for((), None) is None


def test_resolve_marks_shared_prefixes_and_branches() -> None:
    index = LineageIndex()
    a = (1, 2, 3, 4)
    la = index.record(index.resolve(a), a)
    assert index.resolve((1, 2, 3, 4, 5)) == LineageMatch(la, 4)
    branch = index.resolve((1, 2, 9))
    assert branch.lineage is None and branch.parent == la and branch.matched == 2
    lb = index.record(branch, (1, 2, 9))
    assert lb != la
    # (1, 2) is now held by two lineages: a third conversation from there is new.
    assert index.resolve((1, 2, 7)) == LineageMatch(None, 2)
    assert index._owner[2] == SHARED and index._owner[3] == la
    assert index.resolve((1, 2, 3, 4, 8)).lineage == la
    assert index.resolve((1, 2, 9, 10)).lineage == lb


def test_index_is_bounded_and_forgets_tails_first() -> None:
    index = LineageIndex(capacity=10, max_lineages=3)
    for s in range(20):
        chain = tuple(range(s * 100, s * 100 + 6))
        index.record(index.resolve(chain), chain)
        assert len(index) <= 10 and index.lineages <= 3
    last = tuple(range(1900, 1906))
    assert index.resolve(last).lineage is not None
    # An old conversation's hashes are gone: its next turn is a new lineage, not a crash.
    assert index.resolve(tuple(range(8))) == LineageMatch(None, 0)


def test_active_conversations_keep_their_whole_prefix_while_others_churn() -> None:
    """A continued lineage's earlier hashes are not touched at every turn; conversations
    that come back within most of the capacity still continue with everything matched,
    while one-off prompts churn the index past its bound."""
    import random

    rng = random.Random(7)
    index = LineageIndex(capacity=2000, max_lineages=1000)
    chains = {c: [c * 100_000 + i for i in range(40)] for c in range(5)}
    ids = {c: index.record(index.resolve(tuple(h)), tuple(h)) for c, h in chains.items()}
    noise = 10**9
    for turn in range(60):
        for c in rng.sample(sorted(chains), len(chains)):
            h = chains[c]
            before = len(h)
            h.extend(h[-1] + 1 + i for i in range(rng.randint(1, 6)))
            match = index.resolve(tuple(h))
            assert match == LineageMatch(ids[c], before), (turn, c, match)
            index.record(match, tuple(h))
            for _ in range(rng.randint(0, 3)):  # one-off prompts: 20 hashes each
                one = tuple(range(noise, noise + 20))
                noise += 1000
                index.record(index.resolve(one), one)
        assert len(index) <= 2000
    # A conversation gone quiet is forgotten deepest-first once the others push it out.
    quiet = tuple(chains[0])
    for _ in range(200):
        one = tuple(range(noise, noise + 20))
        noise += 1000
        index.record(index.resolve(one), one)
    assert index.resolve(quiet).lineage is None


def test_hashes_evicted_between_routing_and_recording_are_entered_again() -> None:
    index = LineageIndex(capacity=100)
    chain = tuple(range(50))
    lineage = index.record(index.resolve(chain), chain)
    longer = chain + (50, 51)
    match = index.resolve(longer)
    index.resize(10)  # the index shrank while the request was served
    index.resize(100)
    assert index.record(match, longer) == lineage
    assert index.resolve(longer + (52,)) == LineageMatch(lineage, 52)


def test_conversations_size_from_the_replicas_capacity() -> None:
    convs = Conversations(block_tokens=256, capacity_factor=2.0, max_blocks=1 << 20)
    replicas = tuple(
        ReplicaState(ReplicaId(f"r{i}"), "http://x", kv_capacity_tokens=640_000) for i in range(8)
    )
    convs.fit(replicas)
    assert convs.index.capacity == 2 * 8 * 640_000 // 256
    small = replicas[:1]
    convs.fit(small)
    assert convs.index.capacity == 5000


def test_chat_lineages_are_named_by_their_opening_so_other_gateways_agree() -> None:
    t = turns_of("a", 5)
    one, other = Run(), Run()
    k1 = one.body(per_turn(t[:1]))
    assert one.body(per_turn(t[:3])) == k1
    # A gateway that never saw the first turn names the conversation alike.
    assert other.body(per_turn(t[:5])) == k1
    assert k1.startswith("c:")
    # Completions have no opening to go by: their key is the lineage's.
    assert one.body({"model": "m", "prompt": PREAMBLE}, Endpoint.COMPLETIONS).startswith("l:")


def test_conversations_that_open_alike_get_keys_of_their_own() -> None:
    run = Run()
    hi = [("system", PREAMBLE), ("user", "hi")]
    a = run.body(chat(*hi))
    run.body(chat(*hi, ("assistant", "Hello! " * 20), ("user", "plan a trip " * 10)))
    b = run.body(chat(*hi, ("assistant", "Hi there " * 20), ("user", "write a poem " * 10)))
    c = run.body(chat(*hi, ("assistant", "Hey " * 20), ("user", "sing " * 10)))
    assert len({a, b, c}) == 3


def test_a_small_rewrite_of_the_last_turn_continues_within_the_slack() -> None:
    t = turns_of("a", 3)
    edited = [*t[:2], t[2][:-70]]  # the client trimmed the end of its last message
    strict, lenient = Run(), Run(slack_tokens=2 * BT)
    for run, same in ((strict, False), (lenient, True)):
        k = run(hashes(growing(t)))
        assert (run(hashes(growing([*edited, "next " * 30]))) == k) is same


def test_sessions_resolved_together_keep_apart_when_they_differ_past_the_last_block() -> None:
    """20 sessions of one preamble whose own text is shorter than a block, all resolved
    before any is recorded (concurrent first turns), then each going on."""
    convs = Conversations(256)
    hist = {n: [f"Task: fix issue #{n} in module {n * 31}"] for n in range(20)}
    keys: dict[int, set[str]] = {n: set() for n in hist}
    for turn in range(3):
        requests = {
            n: route_request(
                growing(h),
                Endpoint.CHAT,
                "r",
                block_tokens=256,
                max_prefix_blocks=4096,
                lineage=convs.key_for,
            )
            for n, h in hist.items()
        }
        for n, r in requests.items():
            convs.record(r.lineage_hashes, r.session_key, r.lineage_tail)
            keys[n].add(r.session_key)
            hist[n] += ["answer " * 3, f"tool result {turn} for {n}: " + "ok " * 30]
    assert all(len(k) == 1 for k in keys.values()), keys
    assert len({next(iter(k)) for k in keys.values()}) == 20


def test_a_prompt_cut_short_inside_its_last_block_continues_it() -> None:
    """A regenerate after the end of the last message was trimmed (or a trace's repeat of
    a request a few tokens shorter): the same conversation, and both go on in it."""
    run = Run()
    report = "Quarterly figures: " + "revenue up, costs flat. " * 30
    ask = "Summarise the report above in three bullet points"

    def tail_of(body: dict[str, Any]) -> bytes:
        return Run().request(body).lineage_tail

    # An ask whose end fills most of the last (64-byte) block, so the cut stays inside it.
    while len(tail_of(body := chat(("system", PREAMBLE), ("user", report + ask)))) < 40:
        ask += "!"
    cut = report + ask[:-20]
    full = run.body(body)
    assert run.body(chat(("system", PREAMBLE), ("user", cut))) == full
    # Its next turn extends the shorter prompt: still the same conversation.
    reply = [("assistant", "- up\n- flat\n- fine"), ("user", "Now in one line.")]
    assert run.body(chat(("system", PREAMBLE), ("user", cut), *reply)) == full
    # Another request over the same report that asks something else is a conversation of
    # its own, though it shares every whole block with the first.
    other = run.body(chat(("system", PREAMBLE), ("user", report + "List every figure.")))
    assert other != full


def test_cut_short_needs_the_very_bytes_of_the_tail() -> None:
    """Ending inside the tail is not enough: the bytes must be the tail's first ones."""
    index = LineageIndex()
    chain = (1, 2, 3)
    la = index.record(index.resolve(chain), chain, tail=b"summarise it")

    def prompt_ending(rest: bytes) -> TailProbe:
        return lambda count, length: rest[:length]

    assert index.resolve(chain, prompt_ending(b"summ")).lineage == la
    assert index.resolve(chain, prompt_ending(b"list")) == LineageMatch(None, 3, parent=la)


def test_tails_are_bounded_in_bytes() -> None:
    index = LineageIndex(capacity=64)
    for s in range(200):
        chain = (s * 10 + 1, s * 10 + 2)
        index.record(index.resolve(chain), chain, tail=bytes([65 + s % 26]) * 500)
        assert index.tail_bytes <= TAIL_BYTES_PER_HASH * index.capacity
    assert index.tail_bytes > 0
    # The newest conversation kept its tail: a sibling that differs there stays apart.
    last = (1991, 1992)
    assert index.resolve(last, lambda n, k: b"Z" * k).lineage is None


MOONCAKE = (
    Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "synthetic_trace.jsonl"
)


@pytest.mark.skipif(not MOONCAKE.exists(), reason="needs the shared Mooncake trace")
@pytest.mark.parametrize("layout", ["growing", "turns"])
def test_rendered_follow_ups_continue_their_parent_as_trace_hashes_say(layout: Layout) -> None:
    """The gateway's rule on rendered bodies (bytes, tails) names the conversations that
    the same rule on the trace's block hashes names (what `kvgate simulate` routes by). The
    Mooncake trace repeats many requests a few tokens shorter: before a prompt cut short
    inside its last block continued its conversation, half of the follow-ups were new ones."""
    trace = read_trace(MOONCAKE).window(2993, 800)
    records, bt = trace.records, trace.block_tokens
    renderer = Renderer(PromptBuilder(bt), records, bt)
    live, offline = Conversations(bt), Conversations(bt)
    live_keys, offline_keys = [], []
    for i, rec in enumerate(records):
        body = build_body(
            renderer.content(i, chat=True, layout=layout),
            rec,
            model="m",
            endpoint="chat",
            ignore_eos=True,
            max_output_tokens=16,
        )
        r = route_request(
            body, Endpoint.CHAT, "r", block_tokens=bt, max_prefix_blocks=2048, lineage=live.key_for
        )
        live.record(r.lineage_hashes, r.session_key, r.lineage_tail)
        live_keys.append(r.session_key)
        hashes = route_request_for(rec, i, bt, "m", sessions=False).prefix_hashes
        key = offline.key_for(hashes, None)
        if key is not None:
            offline.record(hashes, key)
        offline_keys.append(key or f"own-{i}")
    parents = [(i, p.parent) for i, p in enumerate(renderer.plans) if p.parent is not None]
    same_live = sum(live_keys[i] == live_keys[p] for i, p in parents)
    same_offline = sum(offline_keys[i] == offline_keys[p] for i, p in parents)
    assert len(parents) > 300
    assert same_live >= 0.97 * same_offline, (same_live, same_offline, len(parents))
