"""Trace records as the policies see them (gateway.trace.routing): which key a request is
routed on with and without session ids, only full blocks hashed, and the lineage rule
keeping a conversation's turns together when the client sends no id."""

from __future__ import annotations

from gateway.trace.format import TraceRecord
from gateway.trace.routing import PolicyDriver, make_replicas, route_request_for, session_key_for
from gateway.types import ClusterView

BT = 16


def turn(blocks: int, session: str | None = None, last: int = BT) -> TraceRecord:
    return TraceRecord(0.0, (blocks - 1) * BT + last, 2, tuple(range(100, 100 + blocks)), last,
                       session)  # fmt: skip


def test_the_key_is_the_session_then_the_opening_block_then_the_index() -> None:
    assert session_key_for(turn(3, "s1"), 0) == "s1"
    assert session_key_for(turn(3), 0) == f"{100:x}"  # the conversation's opening block
    assert session_key_for(TraceRecord(0.0, 5, 1), 7) == "req-7"


def test_only_full_blocks_are_hashed_and_ids_can_be_dropped() -> None:
    partial = turn(3, "s1", last=5)  # 37 tokens: two full blocks and five tokens
    req = route_request_for(partial, 4, BT)
    assert req.prefix_hashes == (100, 101) and req.prompt_tokens == 37
    assert (req.session_key, req.key_source, req.request_id) == ("s1", "session", "trace-4")
    assert (req.max_tokens, req.stream, req.block_tokens) == (2, True, BT)
    anonymous = route_request_for(partial, 4, BT, sessions=False)
    assert anonymous.key_source == "conversation" and anonymous.session_key == f"{100:x}"
    full = route_request_for(turn(3, last=BT), 0, BT)
    assert full.prefix_hashes == (100, 101, 102)


def test_lineage_keeps_a_conversations_turns_on_one_replica() -> None:
    replicas = make_replicas(4)
    assert [r.id for r in replicas] == ["r0", "r1", "r2", "r3"]
    driver = PolicyDriver("lineage", replicas, block_tokens=BT)
    view = ClusterView(replicas=replicas, now=0.0)
    placed: list[str] = []
    keys: list[str] = []
    for conv in range(6):
        chosen, named = set(), set()
        for blocks in (4, 8, 12):
            hashes = tuple(conv * 1000 + k for k in range(blocks))
            rec = TraceRecord(0.0, blocks * BT, 2, hashes, BT)
            request = driver.resolve(route_request_for(rec, len(placed), BT, sessions=False))
            assert request.key_source == "lineage"
            replica = driver.choose(request, view)
            driver.prefilled(request)
            driver.finished(request, replica, True, 0.01)
            chosen.add(replica)
            named.add(request.session_key)
            placed.append(replica)
        # Each later turn extends the first: one lineage key, so one replica.
        assert len(chosen) == 1 and len(named) == 1
        keys += named
    assert len(set(keys)) == 6 and all(k.startswith("l:") for k in keys)
    assert len(set(placed)) > 1 and driver.unrouted == 0


def test_without_the_lineage_rule_requests_keep_the_conversation_key() -> None:
    replicas = make_replicas(2)
    driver = PolicyDriver("lineage", replicas, block_tokens=BT, lineage=False)
    request = route_request_for(turn(4), 0, BT, sessions=False)
    assert driver.resolve(request) is request
    with_id = route_request_for(turn(4, "s9"), 0, BT)
    assert PolicyDriver("lineage", replicas, block_tokens=BT).resolve(with_id) is with_id
