"""What routing reads: the events' blocks per synced replica, and the prompts in flight."""

from __future__ import annotations

from gateway.hooks import RequestOutcome
from gateway.keys import route_request
from gateway.kvevents.bridge import PromptBridge
from gateway.kvevents.evidence import EventEvidence
from gateway.kvevents.feed import EventFeed
from gateway.kvevents.index import EventIndex
from gateway.kvevents.learn import learn_prompt
from gateway.kvevents.render import SimRenderer
from gateway.kvevents.wire import BlockStored, EventBatch
from gateway.sim.tokenizer import approx_token_ids, render_chat
from gateway.types import Endpoint, ReplicaId, RouteRequest

A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")
BLOCK_TOKENS = 16  # prompt hash blocks of 64 bytes
SYSTEM = "You review pull requests for a storage engine; be terse. " * 8


def body(*texts: str) -> dict[str, object]:
    roles = ["system"] + ["user", "assistant"] * len(texts)
    return {"model": "m", "messages": [{"role": r, "content": t} for r, t in zip(roles, texts)]}


def request(b: dict[str, object], rid: str) -> RouteRequest:
    return route_request(b, Endpoint.CHAT, rid, block_tokens=BLOCK_TOKENS, max_prefix_blocks=4096)


def engine_stores(index: EventIndex, replica: ReplicaId, b: dict[str, object]) -> int:
    """What the simulated engine publishes for this prompt: every full block. Returns tokens."""
    ids = list(approx_token_ids(render_chat(b["messages"])))  # type: ignore[arg-type]
    n = len(ids) // 16
    index.apply(
        replica, [BlockStored(tuple(range(1, n + 1)), None, tuple(ids[: n * 16]), 16, None, "GPU")]
    )
    return n * 16


def rig() -> tuple[EventEvidence, EventFeed]:
    index = EventIndex()
    feed = EventFeed(index, warmup_s=60.0)
    for replica in (A, B, C):
        feed.reset(replica, True, "start")
    return EventEvidence(index, feed, PromptBridge(), {"GPU": 1.0}, block_size=16), feed


def teach(evidence: EventEvidence, b: dict[str, object], rid: str) -> None:
    r = request(b, rid)
    learnt = learn_prompt(SimRenderer(), b, Endpoint.CHAT, r.prefix_hashes, BLOCK_TOKENS * 4, 16)
    assert learnt is not None
    evidence.bridge.learn(*learnt)


def test_events_answer_for_every_synced_replica_once_the_prompt_is_learnt() -> None:
    evidence, feed = rig()
    turn1 = body(SYSTEM, "Is the compaction change safe? " * 6)
    turn2 = body(SYSTEM, "Is the compaction change safe? " * 6, "Mostly. " * 4, "Why? " * 20)
    held = engine_stores(evidence.index, A, turn1)
    assert evidence.cached_tokens(request(turn2, "t2")) is None  # nothing learnt yet
    teach(evidence, turn1, "t1")
    answer = evidence.cached_tokens(request(turn2, "t2b"))
    assert answer is not None
    assert 0.8 * held <= answer[A] <= held and answer[B] == answer[C] == 0
    feed.connection(B, False)  # down: left to the approximate index
    answer = evidence.cached_tokens(request(turn2, "t2c"))
    assert answer is not None and B not in answer and A in answer


def test_a_prompt_in_flight_counts_where_it_was_sent() -> None:
    evidence, feed = rig()
    turn1 = body(SYSTEM, "Is the compaction change safe? " * 6)
    turn2 = body(SYSTEM, "Is the compaction change safe? " * 6, "Mostly. " * 4, "Why? " * 20)
    r1, r2 = request(turn1, "t1"), request(turn2, "t2")
    # Sent, not learnt, no event yet: only the dispatch says where its blocks will be.
    evidence.dispatched(r1, B, turn1)
    assert evidence.cached_tokens(r1) is None  # a request does not count its own prompt
    answer = evidence.cached_tokens(r2)
    assert answer == {B: len(r1.prefix_hashes) * BLOCK_TOKENS}
    # The events and the bridge catch up: the replica that stored it answers by its events.
    held = engine_stores(evidence.index, A, turn1)
    teach(evidence, turn1, "t1")
    answer = evidence.cached_tokens(request(turn2, "t2b"))
    assert answer is not None and answer[A] > 0.8 * held and answer[B] > 0 and answer[C] == 0
    feed.connection(B, False)
    assert B not in (evidence.cached_tokens(request(turn2, "t2c")) or {})
    feed.connection(B, True)
    feed.batch(B, 0, EventBatch(0.0, ()))
    evidence.finished(RequestOutcome(None, "t1", "chat", None, 200, True, False))
    answer = evidence.cached_tokens(request(turn2, "t2d"))
    assert answer is not None and answer[B] == 0  # the request ended: its blocks are evictable
