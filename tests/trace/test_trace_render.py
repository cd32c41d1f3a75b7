"""Turn boundaries, sessions and message layouts read from a trace's prefix structure."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from gateway.trace.format import Trace, TraceHeader, TraceRecord, read_trace
from gateway.trace.generate import AgentTraceOptions, generate_agent_trace
from gateway.trace.render import (
    SYSTEM_PROMPT,
    Link,
    Message,
    Renderer,
    full_blocks,
    infer_sessions,
    join_block,
    link_requests,
    plan_requests,
    segment_bounds,
    session_headers,
)
from gateway.trace.replay import PromptBuilder

BT = 4
# The shared traces sit beside the repository (../shared/traces).
MOONCAKE = (
    Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "synthetic_trace.jsonl"
)


def rec(hashes: tuple[int, ...], last: int = BT, session: str | None = None) -> TraceRecord:
    return TraceRecord(0.0, (len(hashes) - 1) * BT + last, 1, hashes, last, session)


HAND = (
    rec((1, 2, 3), last=2),  # 0: a root, partial last block
    rec((1, 2, 5, 6)),  # 1: its child (0's full blocks 1, 2 are a prefix)
    rec((1, 8, 9)),  # 2: no parent, shares block 1 (a preamble)
    rec((1, 2, 5, 6, 10), last=1),  # 3: child of 1 (the latest of 0 and 1)
    rec((1, 2)),  # 4: child of 0, nothing new after 0's full blocks
    rec((1, 2, 5, 6, 11)),  # 5: 0, 1, 3 and 4 qualify; 1 and 3 have most, 3 is the latest
    rec((20,), last=3),  # 6: alone, no full block
    rec((20, 21), last=1),  # 7: 6 has no full block, so no parent and nothing shared
)


def test_parents_are_the_longest_then_latest_full_block_prefix() -> None:
    assert link_requests(HAND, BT) == (
        Link(None, 0),
        Link(0, 2),
        Link(None, 1),
        Link(1, 4),
        Link(0, 2),
        Link(3, 4),
        Link(None, 0),
        Link(None, 0),
    )


def test_segments_extend_the_parent_segments() -> None:
    links = link_requests(HAND, BT)
    # Token positions: a child's segments are its parent's, to the parent's end, plus one.
    assert segment_bounds(HAND, BT, links) == (
        (10,),
        (10, 16),  # the new segment starts inside block 2, where 0's partial block ends
        (4, 12),  # the shared preamble, then the rest
        (10, 16, 17),
        (8,),  # shorter than its parent 0: cut at its own end
        (10, 16, 17, 20),
        (3,),
        (5,),
    )


def test_a_parent_with_a_different_block_is_not_taken() -> None:
    # A non-chained trace: equal last hash at the same position but another first block.
    recs = (rec((1, 2)), rec((7, 2, 3)))
    assert link_requests(recs, BT) == (Link(None, 0), Link(None, 0))


def test_sessions_follow_parents_and_keep_known_ones() -> None:
    links = link_requests(HAND, BT)
    sessions = infer_sessions(HAND, links)
    assert sessions[0] == sessions[1] == sessions[3] == sessions[4] == sessions[5]
    assert len(set(sessions)) == 4
    known = tuple(replace(r, session_id=f"k{i}") if i == 3 else r for i, r in enumerate(HAND))
    kept = infer_sessions(known, links)
    assert kept[3] == kept[5] == "k3" and kept[0] == kept[1] == kept[4] == sessions[0]
    assert infer_sessions(known, links, keep_known=False) == sessions


def test_session_headers() -> None:
    assert session_headers("s1") == {"x-session-id": "s1", "x-smg-routing-key": "s1"}
    assert session_headers(None) == {} and session_headers("") == {}


def check_layouts(records: tuple[TraceRecord, ...], bt: int) -> tuple[int, int]:
    """Assert the layout contracts on every request; return (children, shorter children)."""
    renderer = Renderer(PromptBuilder(bt), records, bt)

    def turns(i: int) -> list[Message]:
        out = renderer.content(i, chat=True, layout="turns")
        assert isinstance(out, list)
        return out

    texts = [renderer.text(i) for i in range(len(records))]
    children = shorter = 0
    for i, plan in enumerate(renderer.plans):
        # ~4 characters a token: the prompt has the trace's length.
        assert len(texts[i]) == 4 * records[i].input_tokens
        mine = turns(i)
        # Both layouts carry the same text; completions get it as a string.
        grow = renderer.content(i, chat=True)
        assert isinstance(grow, list) and [m["role"] for m in grow] == ["system", "user"]
        assert grow[0]["content"] == SYSTEM_PROMPT
        text = renderer.content(i, chat=False, layout="turns")
        assert text == grow[1]["content"] == "".join(m["content"] for m in mine) == texts[i]
        roles = [m["role"] for m in mine]
        assert roles[0] == "system"
        assert all(r == ("user" if k % 2 else "assistant") for k, r in enumerate(roles) if k)
        p = plan.parent
        if p is None:
            continue
        children += 1
        theirs = turns(p)
        if records[i].input_tokens >= records[p].input_tokens:
            # The parent's prompt, byte for byte, then the new text in new messages.
            assert texts[i].startswith(texts[p])
            assert mine[: len(theirs)] == theirs
            assert len(mine) == len(theirs) + (len(texts[i]) > len(texts[p]))
        else:
            # Shorter than its parent (it cannot extend it): a prefix of the parent's text.
            shorter += 1
            assert texts[p].startswith(texts[i])
            assert mine[:-1] == theirs[: len(mine) - 1]
    return children, shorter


def test_layout_contracts_on_hand_made_trace() -> None:
    children, shorter = check_layouts(HAND, BT)
    assert (children, shorter) == (4, 1)  # 4 stops inside its parent's partial block


def test_a_child_joins_the_parent_partial_block() -> None:
    builder = PromptBuilder(BT)
    renderer = Renderer(builder, HAND, BT)
    parent, child = renderer.block_texts(0), renderer.block_texts(1)
    assert parent[2] == builder.block_text(3, 2) and len(parent[2]) == 8
    # 0's two tokens of block 2, then block 5's text from there on: a whole block.
    assert child[2] == parent[2] + builder.block_text(5, BT)[8:]
    assert child[:2] == parent[:2] and child[3] == builder.block_text(6, BT)
    assert renderer.segments(1) == ["".join(parent), builder.block_text(5, BT)[8:] + child[3]]
    # Grandchild 3 keeps the join on what is now a full block; 5 joins 3's partial block.
    assert renderer.block_texts(3)[2] == renderer.block_texts(5)[2] == child[2]
    assert renderer.block_texts(5)[4] == renderer.block_texts(3)[4] + builder.block_text(11, 4)[4:]
    # 4 is shorter than its parent: the parent's text, cut at 4's end.
    assert renderer.text(4) == "".join(parent)[:32]
    assert join_block("abcd", "wxyz0123") == "abcd0123" and join_block("abcd", "wx") == "ab"


def test_joins_chain_through_partial_blocks_and_survive_eviction() -> None:
    # Each turn ends inside block 1: every join starts with the previous turn's join.
    recs = (rec((1, 2), last=1), rec((1, 3), last=2), rec((1, 4), last=3), rec((1, 5, 6), last=2))
    builder = PromptBuilder(BT)
    renderer = Renderer(builder, recs, BT)
    texts = [renderer.text(i) for i in range(len(recs))]
    assert [p.parent for p in renderer.plans] == [None, 0, 1, 2]
    assert all(texts[k + 1].startswith(texts[k]) for k in range(3))
    assert texts[3][16:32] == builder.block_text(2, 1) + builder.block_text(3, 2)[4:] + (
        builder.block_text(4, 3)[8:] + builder.block_text(5, 4)[12:]
    )
    assert renderer.segments(3) == [texts[0], texts[1][20:], texts[2][24:], texts[3][28:]]
    # A one-entry cache, rendered backwards, rebuilds the same texts.
    tiny = Renderer(builder, recs, BT, cache_size=1)
    assert [tiny.text(i) for i in reversed(range(len(recs)))] == texts[::-1]
    assert [tiny.segments(i) for i in range(len(recs))] == [
        renderer.segments(i) for i in range(len(recs))
    ]


@pytest.fixture(scope="module")
def agent() -> Trace:
    opts = AgentTraceOptions(seed=3, sessions=16, context_scale=0.05, block_tokens=16)
    return generate_agent_trace(opts)


def test_layout_contracts_on_generated_agent_trace(agent: Trace) -> None:
    children, _ = check_layouts(agent.records, agent.block_tokens)
    # Every turn but a session's first has its previous turn as parent.
    assert children == len(agent.records) - 16


def test_layout_contracts_on_agent_trace_with_default_blocks() -> None:
    trace = generate_agent_trace(AgentTraceOptions(seed=1, sessions=8, context_scale=0.1))
    records, bt = trace.records, trace.block_tokens
    children, _ = check_layouts(records, bt)
    assert children >= len(records) - 8
    # A later turn's parent is its previous turn, or a request with as many full blocks
    # (a sibling session, when the previous turn held no more than the shared preamble).
    previous: dict[str | None, int] = {}
    same = later = 0
    for i, plan in enumerate(plan_requests(records, bt)):
        prev = previous.get(records[i].session_id)
        previous[records[i].session_id] = i
        if prev is None:
            continue
        later += 1
        assert plan.parent is not None
        assert full_blocks(records[plan.parent], bt) >= full_blocks(records[prev], bt)
        same += records[plan.parent].session_id == records[i].session_id
    assert later == len(records) - 8 and same >= later - 2


def partition_agreement(truth: list[str], inferred: tuple[str, ...]) -> float:
    """Share of requests in the true session that is the majority of their inferred one."""
    pairs = Counter(zip(inferred, truth))
    best: dict[str, int] = {}
    for (group, _), n in pairs.items():
        best[group] = max(best.get(group, 0), n)
    return sum(best.values()) / len(truth)


def test_inferred_sessions_match_the_real_ones(agent: Trace) -> None:
    truth = [r.session_id or "" for r in agent.records]
    stripped = tuple(replace(r, session_id=None) for r in agent.records)
    inferred = infer_sessions(stripped, link_requests(stripped, agent.block_tokens))
    assert len(set(inferred)) == len(set(truth))
    assert partition_agreement(truth, inferred) == 1.0
    assert partition_agreement(list(inferred), tuple(truth)) == 1.0


def test_inferred_sessions_at_default_size() -> None:
    trace = generate_agent_trace(AgentTraceOptions(seed=1, sessions=32))
    truth = [r.session_id or "" for r in trace.records]
    stripped = tuple(replace(r, session_id=None) for r in trace.records)
    inferred = infer_sessions(stripped, link_requests(stripped, trace.block_tokens))
    assert partition_agreement(truth, inferred) >= 0.99
    assert partition_agreement(list(inferred), tuple(truth)) >= 0.99


@pytest.mark.skipif(not MOONCAKE.exists(), reason="needs the shared Mooncake trace")
def test_layout_contracts_on_the_mooncake_trace() -> None:
    trace = read_trace(MOONCAKE).window(0, 1500)
    children, shorter = check_layouts(trace.records, trace.block_tokens)
    assert children > 100 and shorter < children
    plans = plan_requests(trace.records, trace.block_tokens)
    assert 1 < len({p.session_id for p in plans}) < len(plans)


def test_records_without_hashes_are_one_unique_segment() -> None:
    builder = PromptBuilder(BT)
    recs = (TraceRecord(0.0, 12, 1), TraceRecord(1.0, 12, 1))
    renderer = Renderer(builder, recs, BT)
    assert [p.bounds for p in renderer.plans] == [(), ()]
    assert renderer.plans[0].session_id != renderer.plans[1].session_id
    out = [renderer.content(i, chat=True, layout="turns") for i in range(len(recs))]
    assert out[0] == [{"role": "system", "content": builder.prompt(recs[0], 0)}]
    assert out[0] != out[1]


def test_unknown_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="layout"):
        Renderer(PromptBuilder(BT), HAND, BT).content(0, chat=True, layout="flat")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="plan"):
        Renderer(PromptBuilder(BT), HAND, BT, plan_requests(HAND[:2], BT))


def test_trace_header_block_size_is_what_counts() -> None:
    # Block size 8: record 0's 10 tokens are one full and one partial block.
    records = (TraceRecord(0.0, 10, 1, (1, 2), 2), TraceRecord(1.0, 16, 1, (1, 3), 8))
    trace = Trace(TraceHeader(block_tokens=8), records)
    assert link_requests(trace.records, trace.block_tokens)[1] == Link(0, 1)
