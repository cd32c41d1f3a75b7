"""The `cost` policy where a session's replica is gone, left the membership, or (by the
engines' own KV events) evicted the session's prefix; and `cached_tokens` as admission
and PD read it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from policy_views import replicas, request, rid, view
from test_cost_policy import rig, turn

from gateway.policy import RANK_DEPTH, PolicyContext
from gateway.types import ClusterView, ReplicaId, RouteRequest
from plugins.cost import Cost, CostConfig

HISTORY = tuple(range(500, 520))  # 20 blocks of 512 tokens


@dataclasses.dataclass(frozen=True)
class Events:
    """A `CacheEvidence` answering from a table, as gateway.kvevents would."""

    held: Mapping[ReplicaId, int] | None

    def cached_tokens(self, request: RouteRequest) -> Mapping[ReplicaId, int] | None:
        return self.held


def with_events(v: ClusterView, held: Mapping[ReplicaId, int] | None) -> ClusterView:
    return dataclasses.replace(v, cache_evidence=Events(held))


def test_a_sticky_session_whose_replica_is_out_fails_over_and_ranks_all_others() -> None:
    p, v, _ = rig(n=4)
    first = turn("s", HISTORY, 0)
    home = p.choose(first, v).first
    assert home is not None
    p.placed(first, home)
    assert p.choose(turn("s", HISTORY, 1), v).reason == "sticky"
    without = dataclasses.replace(
        v, replicas=tuple(r for r in v.replicas if r.id != home), by_id=None
    )
    choice = p.choose(turn("s", HISTORY, 1), without)
    assert choice.reason == "failover" and home not in choice.ranked
    assert sorted(choice.ranked) == sorted(r.id for r in without.replicas)


def test_sticky_failover_order_is_the_ring_then_everyone_up_to_the_depth() -> None:
    states = replicas(RANK_DEPTH + 4)
    p = Cost(CostConfig(), PolicyContext(states))
    v = view(states)
    req = dataclasses.replace(request("s", HISTORY, 512), sticky_replica=rid(7))
    choice = p.choose(req, v)
    assert choice.reason == "sticky" and choice.first == rid(7)
    assert len(choice.ranked) == RANK_DEPTH and len(set(choice.ranked)) == RANK_DEPTH
    # The same session fails over in the same order each time (its ring walk).
    assert p.choose(req, v).ranked == choice.ranked


def test_a_replica_leaving_the_membership_takes_its_sessions_and_prefixes_along() -> None:
    p, v, _ = rig(n=3)
    req = turn("s", HISTORY, 0)
    home = p.choose(req, v).first
    assert home is not None
    p.placed(req, home)
    assert p.cached_tokens(req, home) == len(HISTORY) * 512
    p.membership_changed(tuple(r for r in v.replicas if r.id != home))
    assert p.cached_tokens(req, home) == 0
    assert p.sessions.replica_of("s", v.now) is None
    again = p.choose(turn("s", HISTORY, 1), v)
    assert again.reason == "least_wait"  # nothing held anywhere: ranked afresh


def test_events_saying_the_sticky_replica_evicted_the_prefix_move_the_session() -> None:
    p, v, _ = rig(n=3)
    req = turn("s", HISTORY, 0)
    home = p.choose(req, v).first
    assert home is not None
    p.placed(req, home)
    other = next(r.id for r in v.replicas if r.id != home)
    full = len(HISTORY) * 512
    # The engines say: home kept a quarter of it, `other` holds all of it (a fork went there).
    moved = p.choose(turn("s", HISTORY, 1), with_events(v, {home: full // 4, other: full}))
    assert (moved.reason, moved.first) == ("evicted", other)
    # Holding half or more of the best is not an eviction: the session stays.
    stays = p.choose(turn("s", HISTORY, 1), with_events(v, {home: full // 2, other: full}))
    assert (stays.reason, stays.first) == ("sticky", home)
    # Events that do not know the prompt's tokens yet move no one...
    assert p.choose(turn("s", HISTORY, 1), with_events(v, None)).reason == "sticky"
    # ...but the sticky engine saying it holds none of it is an eviction, even when no
    # one else holds it either: the session is ranked by wait alone.
    gone = p.choose(turn("s", HISTORY, 1), with_events(v, {home: 0, other: 0}))
    assert gone.reason == "evicted"


def test_cached_tokens_prefer_the_events_and_never_exceed_the_prompt() -> None:
    p, v, _ = rig(n=3)
    req = turn("s", HISTORY, 0)
    p.placed(req, rid(0))
    prompt = req.prompt_tokens
    assert p.cached_tokens(req, rid(0)) == prompt  # the prefix index's estimate
    p.choose(req, with_events(v, {rid(1): prompt * 2, rid(2): 512}))
    assert p.cached_tokens(req, rid(1)) == prompt  # clipped to the prompt
    assert p.cached_tokens(req, rid(2)) == 512
    assert p.cached_tokens(req, rid(0)) == prompt  # not in the events: the index answers
    assert p.cached_tokens(dataclasses.replace(req, prefix_hashes=()), rid(0)) == 0


def test_a_prefix_held_by_the_events_ranks_its_holder_first_for_a_new_session() -> None:
    p, v, _ = rig(n=3)
    req = turn("new", HISTORY, 0)
    choice = p.choose(req, with_events(v, {rid(2): req.prompt_tokens}))
    assert (choice.first, choice.reason) == (rid(2), "prefix")
