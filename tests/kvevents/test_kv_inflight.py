"""Prompts in flight count as cached where they were sent, until their requests end."""

from __future__ import annotations

import random

from gateway.kvevents.inflight import InFlight
from gateway.types import ReplicaId

A, B = ReplicaId("a"), ReplicaId("b")


def test_a_prompt_counts_on_its_replica_until_its_request_ends() -> None:
    flying = InFlight()
    flying.dispatched("r1", A, (1, 2, 3))
    assert flying.matched(A, (1, 2, 3, 4)) == 3
    assert flying.matched(A, (1, 2, 9)) == 2
    assert flying.matched(A, (7, 8)) == 0
    assert flying.matched(B, (1, 2, 3)) == 0
    flying.done("r1")
    assert flying.matched(A, (1, 2, 3)) == 0 and len(flying) == 0
    assert list(flying.replicas()) == []
    flying.done("r1")  # idempotent: an outcome after a failover's own cleanup


def test_shared_blocks_are_counted_per_prompt() -> None:
    flying = InFlight()
    flying.dispatched("r1", A, (1, 2, 3))
    flying.dispatched("r2", A, (1, 2, 5, 6))
    flying.done("r1")
    assert flying.matched(A, (1, 2, 3)) == 2  # r2 still holds the shared preamble
    assert flying.matched(A, (1, 2, 5, 6, 7)) == 4


def test_a_request_does_not_count_its_own_prompt() -> None:
    flying = InFlight()
    flying.dispatched("r1", A, (1, 2, 3))
    assert flying.matched(A, (1, 2, 3), "r1") == 0
    flying.dispatched("r2", A, (1, 2))
    assert flying.matched(A, (1, 2, 3), "r1") == 2
    assert flying.matched(A, (1, 2, 3), "r2") == 3


def test_a_failover_moves_the_prompt_and_the_oldest_go_past_the_bound() -> None:
    flying = InFlight(max_requests=2)
    flying.dispatched("r1", A, (1, 2))
    flying.dispatched("r1", B, (1, 2))
    assert flying.matched(A, (1, 2)) == 0 and flying.matched(B, (1, 2)) == 2
    flying.dispatched("r2", A, (3,))
    flying.dispatched("r3", A, (4,))
    assert len(flying) == 2 and flying.matched(B, (1, 2)) == 0  # r1 was the oldest
    assert flying.matched(A, (3,)) == 1 and flying.matched(A, (4,)) == 1
    flying.dispatched("r4", A, ())  # no prompt hashes: nothing to count
    assert len(flying) == 2


def chained(tokens: list[int]) -> tuple[int, ...]:
    out, h = [], 0
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return tuple(out)


def test_binary_search_agrees_with_a_plain_walk() -> None:
    rng = random.Random(7)
    flying = InFlight()
    prompts: dict[str, tuple[int, ...]] = {}
    for i in range(400):
        # Few distinct tokens: prompts share prefixes and fork, as conversations do.
        prompt = chained([rng.randint(0, 2) for _ in range(rng.randint(1, 12))])
        rid = f"r{i}"
        flying.dispatched(rid, A, prompt)
        prompts[rid] = prompt
        if rng.random() < 0.4:
            gone = rng.choice(list(prompts))
            flying.done(gone)
            del prompts[gone]
        query = chained([rng.randint(0, 2) for _ in range(rng.randint(1, 12))])
        held = {h for r, p in prompts.items() if r != rid for h in p}
        expected = 0
        while expected < len(query) and query[expected] in held:
            expected += 1
        assert flying.matched(A, query, rid) == expected
