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
    full_blocks,
    infer_sessions,
    link_requests,
    plan_requests,
    render_content,
    segment_bounds,
    segment_texts,
    session_headers,
    turn_messages,
)
from gateway.trace.replay import PromptBuilder

BT = 4
MOONCAKE = Path("/work/shared/traces/synthetic_trace.jsonl")


def rec(hashes: tuple[int, ...], last: int = BT, session: str | None = None) -> TraceRecord:
    return TraceRecord(0.0, (len(hashes) - 1) * BT + last, 1, hashes, last, session)


HAND = (
    rec((1, 2, 3), last=2),  # 0: a root, partial last block
    rec((1, 2, 5, 6)),  # 1: its child (0's full blocks 1, 2 are a prefix)
    rec((1, 8, 9)),  # 2: no parent, shares block 1 (a preamble)
    rec((1, 2, 5, 6, 10), last=1),  # 3: child of 1 (the latest of 0 and 1)
    rec((1, 2)),  # 4: child of 0, nothing new after 0's full blocks
    rec((1, 2, 5, 6, 11)),  # 5: 0, 1, 3 and 4 qualify; 4 is the latest
    rec((20,), last=3),  # 6: alone, no full block
    rec((20, 21), last=1),  # 7: 6 has no full block, so no parent and nothing shared
)


def test_parents_are_the_latest_full_block_prefix() -> None:
    assert link_requests(HAND, BT) == (
        Link(None, 0),
        Link(0, 2),
        Link(None, 1),
        Link(1, 4),
        Link(0, 2),
        Link(4, 2),
        Link(None, 0),
        Link(None, 0),
    )


def test_segments_cut_the_parent_back_to_its_full_blocks() -> None:
    links = link_requests(HAND, BT)
    assert segment_bounds(HAND, BT, links) == (
        (3,),
        (2, 4),  # 0's partial block 3 is not shared: the boundary is its full blocks
        (1, 3),  # the shared preamble, then the rest
        (2, 4, 5),
        (2,),
        (2, 5),
        (1,),
        (2,),
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
    known = tuple(replace(r, session_id=f"k{i}") if i == 4 else r for i, r in enumerate(HAND))
    kept = infer_sessions(known, links)
    assert kept[4] == kept[5] == "k4" and kept[0] == kept[1] == sessions[0]
    assert infer_sessions(known, links, keep_known=False) == sessions


def test_session_headers() -> None:
    assert session_headers("s1") == {"x-session-id": "s1", "x-smg-routing-key": "s1"}
    assert session_headers(None) == {} and session_headers("") == {}


def check_layouts(records: tuple[TraceRecord, ...], bt: int) -> tuple[int, int]:
    """Assert the layout contracts on every child; return (children, exact full prefixes)."""
    builder = PromptBuilder(bt)
    links = link_requests(records, bt)
    plans = plan_requests(records, bt)

    def turns(i: int) -> list[Message]:
        out = render_content(
            builder,
            records[i],
            i,
            chat=True,
            layout="turns",
            block_tokens=bt,
            bounds=plans[i].bounds,
        )
        assert isinstance(out, list)
        return out

    children = exact = 0
    for i, link in enumerate(links):
        p = link.parent
        if p is None:
            continue
        children += 1
        mine, theirs = turns(i), turns(p)
        # The parent's messages, cut back to its full blocks, are an exact prefix...
        cut = full_blocks(records[p], bt)
        clipped = tuple(b for b in plans[p].bounds if b < cut) + (cut,)
        shared = turn_messages(segment_texts(builder, records[p], p, clipped, bt))
        assert mine[: len(shared)] == shared
        assert mine[: len(theirs) - 1] == theirs[:-1]
        # ...and all of them when the parent ends on a whole block.
        if cut == len(records[p].block_hashes):
            assert mine[: len(theirs)] == theirs
        exact += mine[: len(theirs)] == theirs
        # Growing: the child's user text starts with the parent's full-block text.
        grow = render_content(builder, records[i], i, chat=True, block_tokens=bt)
        assert isinstance(grow, list) and [m["role"] for m in grow] == ["system", "user"]
        assert grow[0]["content"] == SYSTEM_PROMPT
        assert grow[1]["content"].startswith("".join(m["content"] for m in shared))
        # Both layouts carry the same text; completions get it as a string.
        text = render_content(builder, records[i], i, chat=False, layout="turns", block_tokens=bt)
        assert text == grow[1]["content"] == "".join(m["content"] for m in mine)
        roles = [m["role"] for m in mine]
        assert roles[0] == "system"
        assert all(r == ("user" if k % 2 else "assistant") for k, r in enumerate(roles) if k)
    return children, exact


def test_layout_contracts_on_hand_made_trace() -> None:
    children, exact = check_layouts(HAND, BT)
    assert (children, exact) == (4, 2)  # 1 and 4 extend a parent with a partial last block


@pytest.fixture(scope="module")
def agent() -> Trace:
    opts = AgentTraceOptions(seed=3, sessions=16, context_scale=0.05, block_tokens=16)
    return generate_agent_trace(opts)


def test_layout_contracts_on_generated_agent_trace(agent: Trace) -> None:
    children, _ = check_layouts(agent.records, agent.block_tokens)
    # Every turn but a session's first has its previous turn as parent.
    assert children == len(agent.records) - 16


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
    children, _ = check_layouts(trace.records, trace.block_tokens)
    assert children > 100
    plans = plan_requests(trace.records, trace.block_tokens)
    assert 1 < len({p.session_id for p in plans}) < len(plans)


def test_records_without_hashes_are_one_unique_segment() -> None:
    builder = PromptBuilder(BT)
    recs = (TraceRecord(0.0, 12, 1), TraceRecord(1.0, 12, 1))
    plans = plan_requests(recs, BT)
    assert [p.bounds for p in plans] == [(), ()]
    assert plans[0].session_id != plans[1].session_id
    out = [
        render_content(builder, r, i, chat=True, layout="turns", block_tokens=BT, bounds=())
        for i, r in enumerate(recs)
    ]
    assert out[0] == [{"role": "system", "content": builder.prompt(recs[0], 0)}]
    assert out[0] != out[1]


def test_unknown_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="layout"):
        render_content(
            PromptBuilder(BT),
            HAND[0],
            0,
            chat=True,
            layout="flat",  # type: ignore[arg-type]
            block_tokens=BT,
        )


def test_trace_header_block_size_is_what_counts() -> None:
    # Block size 8: record 0's 10 tokens are one full and one partial block.
    records = (TraceRecord(0.0, 10, 1, (1, 2), 2), TraceRecord(1.0, 16, 1, (1, 3), 8))
    trace = Trace(TraceHeader(block_tokens=8), records)
    assert link_requests(trace.records, trace.block_tokens)[1] == Link(0, 1)
