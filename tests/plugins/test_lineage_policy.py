"""The `lineage` policy's placement on hand-built views: stickiness, remembered moves, and
hot preambles that spread while one conversation's fork follows its cache."""

from __future__ import annotations

import dataclasses

from policy_views import load, replicas, request, rid, view

from gateway.policy import RANK_DEPTH, PolicyContext
from gateway.ring import HashRing, RingNode
from gateway.types import ClusterView, ReplicaId, RouteRequest
from plugins.lineage import Lineage, LineageConfig

PREAMBLE = tuple(range(1000, 1040))  # 40 blocks of 512 tokens: an agent kind's preamble


def policy(n: int = 4, **config: object) -> tuple[Lineage, ClusterView]:
    states = replicas(n)
    return Lineage(LineageConfig(**config), PolicyContext(states)), view(states)  # type: ignore[arg-type]


class _Prefill:
    """Prefill signals of idle replicas that all prefill at 10,000 tokens/s."""

    def queued_tokens(self, replica: ReplicaId) -> float:
        return 0.0

    def queued_requests(self, replica: ReplicaId) -> int:
        return 0

    def speed(self, replica: ReplicaId) -> float | None:
        return 10_000.0

    def mean_speed(self) -> float | None:
        return 10_000.0

    def mean_request_tokens(self) -> float:
        return 0.0


def metered(v: ClusterView) -> ClusterView:
    """`v` with measured prefill speeds: the sticky bound, in seconds, applies."""
    return dataclasses.replace(v, prefill=_Prefill())


def serve(p: Lineage, req: RouteRequest, v: ClusterView) -> ReplicaId:
    """Route and complete `req` as the proxy does: choose, dispatched, placed, finished."""
    chosen = p.choose(req, v).first
    assert chosen is not None
    p.dispatched(req, chosen)
    p.placed(req, chosen)
    p.finished(req, chosen, True, 0.1)
    return chosen


def turn(session: str, hashes: tuple[int, ...], n: int) -> RouteRequest:
    return dataclasses.replace(
        request(session, hashes, block_tokens=512), request_id=f"{session}-{n}"
    )


def test_a_conversation_stays_where_it_was_served() -> None:
    p, v = policy()
    history = PREAMBLE + (1,)
    first = serve(p, turn("s", history, 0), v)
    for n in range(1, 6):
        history = history + (100 + n,)
        assert serve(p, turn("s", history, n), v) == first


def test_a_move_over_the_load_bound_is_remembered() -> None:
    p, v = policy(stay_queue_s=0.0)
    v = metered(v)
    home = serve(p, turn("s", (1, 2, 3), 0), v)
    backlog = turn("backlog", tuple(range(50_000, 50_100)), 0)
    p.dispatched(backlog, home)  # 5 s of prefill queued there, none elsewhere
    moved = p.choose(turn("s", (1, 2, 3, 4), 1), v)
    assert moved.reason == "bounded_load" and moved.first != home
    assert moved.first is not None
    p.placed(turn("s", (1, 2, 3, 4), 1), moved.first)
    # The load is gone: the session stays where it moved, not back where it started.
    p.prefilled(backlog)
    again = p.choose(turn("s", (1, 2, 3, 4, 5), 2), v)
    assert again.reason == "sticky" and again.first == moved.first


def test_failover_moves_a_session_and_it_stays_moved() -> None:
    p, v = policy()
    home = serve(p, turn("s", (1, 2), 0), v)
    without = ClusterView(
        tuple(r for r in v.replicas if r.id != home),
        now=v.now,
        stale_after=v.stale_after,
        in_flight={},
    )
    moved = p.choose(turn("s", (1, 2, 3), 1), without)
    assert moved.reason == "failover" and moved.first not in (None, home)
    assert moved.first is not None
    p.placed(turn("s", (1, 2, 3), 1), moved.first)
    assert p.choose(turn("s", (1, 2, 3, 4), 2), v).first == moved.first


def test_sessions_sharing_a_hot_preamble_spread_and_each_sticks() -> None:
    p, v = policy(8)
    homes = {}
    for s in range(16):
        homes[s] = serve(p, turn(f"s{s}", PREAMBLE + (5000 + s,), 0), v)
    per_replica = [list(homes.values()).count(rid(i)) for i in range(8)]
    # The cache pull alone would keep them on the preamble's first replica; with the band
    # only the first session and the `hot_after` (3) that follow it before the preamble
    # counts as hot share one.
    assert max(per_replica) <= 4, per_replica
    assert sum(1 for n in per_replica if n) >= 6, per_replica
    for s in range(16):
        nxt = PREAMBLE + (5000 + s, 6000 + s)
        assert serve(p, turn(f"s{s}", nxt, 1), v) == homes[s]


def test_without_the_band_a_preamble_pulls_new_sessions_together() -> None:
    # The control for the test above: the band, not chance, spreads them.
    p, v = policy(8, session_band=None)
    homes = {serve(p, turn(f"s{s}", PREAMBLE + (5000 + s,), 0), v) for s in range(16)}
    assert len(homes) <= 2


def _later_sessions_on_grown_replica(grow: bool) -> int:
    """8 conversations spread over 4 replicas; those on one replica grow long (or not);
    then 12 new sessions open with one agent preamble. How many land on that replica?"""
    p, v = policy(4)
    homes = [serve(p, turn(f"s{s}", (50_000 + 10 * s,), 0), v) for s in range(8)]
    grown = homes[0]
    if grow:
        for s in (s for s in range(8) if homes[s] == grown):
            long = (50_000 + 10 * s, *range(100_000 + 1000 * s, 100_400 + 1000 * s))
            assert serve(p, turn(f"s{s}", long, 1), v) == grown
    later = [serve(p, turn(f"n{s}", PREAMBLE + (7000 + s,), 0), v) for s in range(12)]
    return later.count(grown)


def test_long_conversations_hold_new_sessions_off_their_replica() -> None:
    # Equal session counts everywhere, but one replica's conversations have grown long:
    # their next turns will send far more tokens, so new sessions skip that replica.
    assert _later_sessions_on_grown_replica(grow=True) == 0


def test_without_long_conversations_that_replica_gets_new_sessions() -> None:
    # The control: the same cluster, conversations left short.
    assert _later_sessions_on_grown_replica(grow=False) >= 2


def test_a_fork_of_one_conversation_follows_its_cache() -> None:
    p, v = policy(8)
    # Other sessions fill the cluster, so the fork's replica is not the emptiest.
    for s in range(8):
        serve(p, turn(f"x{s}", (9000 + s, 9100 + s), 0), v)
    history = (1, 2, 3, 4, 5, 6, 7, 8)
    home = serve(p, turn("parent", history, 0), v)
    fork = p.choose(turn("child", history[:6] + (77,), 0), v)
    assert fork.first == home and fork.reason == "prefix"


def _new_session_home(prefilling: bool = True) -> ReplicaId:
    """r0 carries three live sessions and nothing in flight; r1 one live session whose
    4-block prompt is still prefilling (or done). Where does a new session with no hot
    prefix go?"""
    p, _ = policy(2)
    v = view(replicas(2), inflight={1: 1} if prefilling else {})
    for s in range(3):
        p.placed(turn(f"s{s}", (3000 + s,), 0), rid(0))
    busy = turn("busy", tuple(range(20_000, 20_004)), 0)
    p.dispatched(busy, rid(1))
    p.placed(busy, rid(1))
    if not prefilling:
        p.prefilled(busy)
    chosen = p.choose(turn("new", (40_000,), 0), v)
    assert chosen.reason == "least_cost"
    assert chosen.first is not None
    return chosen.first


def test_a_new_session_with_no_hot_prefix_goes_where_the_load_is_now() -> None:
    # Live sessions only break ties: the prefill waiting on r1 decides.
    assert _new_session_home() == rid(0)


def test_with_no_load_anywhere_fewer_live_sessions_break_the_tie() -> None:
    # The control: nothing queued on either, so the one live session beats three.
    assert _new_session_home(prefilling=False) == rid(1)


def _returns_home_after_its_replica_wrote_twice_its_kv(factor: float) -> bool:
    """A conversation served on one replica (16 blocks of KV), then 32 blocks of other
    prompts written there: does a prompt extending it (known by no session key) go back?"""
    states = replicas(4, kv_capacity_tokens=16 * 512)
    p = Lineage(LineageConfig(index_capacity_factor=factor), PolicyContext(states))
    v = view(states)
    history = (1, 2, 3, 4)
    home = serve(p, turn("a", history, 0), v)
    for s in range(8):
        p.placed(turn(f"o{s}", tuple(range(5000 + 10 * s, 5004 + 10 * s)), 0), home)
    again = p.choose(turn("a-later", (*history, 5, 6), 1), v)
    return again.first == home and again.reason == "prefix"


def test_the_index_remembers_where_a_conversation_went_after_the_engine_evicted_it() -> None:
    # The engine has dropped it, but a copy anywhere else would take a second cache: it
    # goes back (the default index holds 4x the replica's KV).
    assert _returns_home_after_its_replica_wrote_twice_its_kv(LineageConfig().index_capacity_factor)


def test_an_index_the_size_of_the_kv_forgets_it() -> None:
    # The control: an index sized as the engine's cache has forgotten the conversation.
    assert not _returns_home_after_its_replica_wrote_twice_its_kv(1.0)


class Said:
    """What the engines' KV events say each replica holds (a `CacheEvidence`), by hand."""

    def __init__(self, held: dict[ReplicaId, int]) -> None:
        self.held = held

    def cached_tokens(self, request: RouteRequest) -> dict[ReplicaId, int]:
        return self.held


def test_events_that_hold_a_prompt_nowhere_leave_it_to_the_prefix_index() -> None:
    # Every replica's events known, none holding any of the prompt: it is in flight through
    # another gateway (stored nowhere yet) or evicted everywhere. Where it was sent is
    # where it goes, not wherever load is least (a second copy of it).
    p, v = policy(4)
    history = (1, 2, 3, 4)
    home = serve(p, turn("a", history, 0), v)
    for s in range(6):  # other sessions, so the home replica is not the least loaded
        serve(p, turn(f"x{s}", (9000 + s,), 0), v)
    nothing = dataclasses.replace(v, cache_evidence=Said({r.id: 0 for r in v.replicas}))
    elsewhere = p.choose(turn("a-via-another-gateway", (*history, 5), 1), nothing)
    assert elsewhere.first == home and elsewhere.reason == "prefix"
    # Its own session, though, is free to move: whatever it held is held nowhere.
    assert p.choose(turn("a", (*history, 5), 1), nothing).reason == "evicted"
    # The control: events that hold it on another replica say the home replica evicted it.
    other = next(r.id for r in v.replicas if r.id != home)
    held = Said({r.id: 4 * 512 if r.id == other else 0 for r in v.replicas})
    moved = p.choose(turn("a", (*history, 5), 1), dataclasses.replace(v, cache_evidence=held))
    assert moved.reason == "evicted" and moved.first == other


def _warm(p: Lineage, v: ClusterView, sessions: int, turns: int, grow: int) -> None:
    """Conversations of `turns` requests, each turn `grow` new blocks: what the policy
    measures a new session will send after its first request."""
    for s in range(sessions):
        history: tuple[int, ...] = (80_000 + 100 * s,)
        for n in range(turns):
            serve(p, turn(f"w{s}", history, n), v)
            history += tuple(range(90_000 + 1000 * s + 10 * n, 90_000 + 1000 * s + 10 * n + grow))


def _fork_burst(p: Lineage, v: ClusterView, busy: ClusterView | None = None) -> list[bool]:
    """A 40-block conversation, then four subagents branching at its whole history and
    the parent's resume (new sessions each, as without a header): which land home?"""
    history = tuple(range(1, 41))
    home = serve(p, turn("parent", history, 0), v)
    landed = []
    for k in range(4):
        landed.append(serve(p, turn(f"child{k}", (*history, 500 + k), 0), busy or v) == home)
    landed.append(serve(p, turn("resume", (*history, 600), 0), busy or v) == home)
    return landed


def test_forks_and_the_resume_follow_a_deep_history_past_the_hot_threshold() -> None:
    # Four forks and the resume all branch at one point, which makes it "hot" after the
    # third; but the 40 blocks there are held by one replica and a session here sends
    # about one block after its first request: spreading would recompute 40 to balance 1.
    p, v = policy(8)
    _warm(p, v, sessions=8, turns=2, grow=1)
    assert _fork_burst(p, v) == [True] * 5


def test_forks_leave_a_replica_over_the_load_bound() -> None:
    # The same burst, but the history's replica has far more in flight than the bound
    # allows: the band spreads the later ones (the first three come before it is hot).
    p, v = policy(8, stay_queue_s=0.0)
    v = metered(v)
    _warm(p, v, sessions=8, turns=2, grow=1)
    history = tuple(range(1, 41))
    home = serve(p, turn("parent", history, 0), v)
    p.dispatched(turn("backlog", tuple(range(50_000, 50_200)), 0), home)
    busy = v
    for k in range(3):
        serve(p, turn(f"child{k}", (*history, 500 + k), 0), busy)
    later = p.choose(turn("resume", (*history, 600), 0), busy)
    assert later.first != home


def test_a_shallow_hot_preamble_still_spreads_sessions_that_will_send_more() -> None:
    # Sessions of six turns of four blocks each: a new one will send some 20 blocks more,
    # more than the 16-block preamble it opens with. Spreading them costs the preamble's
    # recompute once and balances their later turns, so the band spreads them.
    p, v = policy(8)
    preamble = tuple(range(1000, 1016))
    homes = []
    for s in range(12):
        history = (*preamble, 5000 + s)
        homes.append(serve(p, turn(f"s{s}", history, 0), v))
        for n in range(1, 6):
            history += tuple(range(7000 + 100 * s + 10 * n, 7000 + 100 * s + 10 * n + 4))
            assert serve(p, turn(f"s{s}", history, n), v) == homes[-1]
    assert len(set(homes)) >= 5, homes


def test_a_preamble_every_replica_holds_pulls_no_one() -> None:
    p, v = policy(4)
    _warm(p, v, sessions=4, turns=2, grow=1)
    for i in range(4):  # the preamble everywhere, as after the band has spread it
        p.placed(turn(f"seed{i}", PREAMBLE, 0), rid(i))
    homes = {serve(p, turn(f"n{s}", (*PREAMBLE, 7000 + s), 0), v) for s in range(8)}
    assert len(homes) == 4, homes


def _forks_and_resume(
    p: Lineage, v: ClusterView, turns: int
) -> tuple[ReplicaId, list[ReplicaId], ReplicaId]:
    """Other sessions open with PREAMBLE (it turns hot); one conversation of `turns` turns
    grows a 60-block history past it; then 4 forks of that history and the parent's
    resume, each a new session (as lineage inference keys them). Where do they go?"""
    for s in range(6):
        serve(p, turn(f"x{s}", (*PREAMBLE, 9000 + s), 0), v)
    history: tuple[int, ...] = (*PREAMBLE, 1)
    home = serve(p, turn("parent", history, 0), v)
    for n in range(1, turns):
        history = (*history, *range(100 * n, 100 * n + 60 // max(1, turns - 1)))
        assert serve(p, turn("parent", history, n), v) == home
    forks = [serve(p, turn(f"fork{k}", (*history, 7000 + k), 0), v) for k in range(4)]
    resume = serve(p, turn("resume", (*history, 8000), 0), v)
    return home, forks, resume


def test_forks_and_the_resume_follow_a_deep_history_past_hot_after() -> None:
    # Five sessions branch at the history's end (more than hot_after): it is not a
    # preamble, as the prefix one replica holds beyond what most hold (60 blocks) is far
    # more than a new session sends later (measured: about one more turn of a block).
    p, v = policy(8)
    home, forks, resume = _forks_and_resume(p, v, turns=4)
    assert forks == [home] * 4 and resume == home


def test_the_control_before_any_continued_turn_the_band_spreads_them() -> None:
    # The control: with one turn nothing has measured what a session sends later, the
    # band alone decides, and the hot branch point spreads the later forks.
    p, v = policy(8)
    home, forks, resume = _forks_and_resume(p, v, turns=1)
    assert set(forks + [resume]) != {home}


def test_a_deep_history_over_the_load_bound_does_not_pull() -> None:
    p, v = policy(8, stay_queue_s=0.0)
    v = metered(v)
    home, _, _ = _forks_and_resume(p, v, turns=4)
    fork = turn("late", (*PREAMBLE, 1, *range(100, 120), 7100), 0)
    assert p.choose(fork, v).first == home
    # 400K tokens of prefill queued there (sent, no first token yet): recomputing the
    # 31-block history elsewhere is sooner.
    p.dispatched(turn("backlog", tuple(range(50_000, 50_800)), 0), home)
    assert p.choose(fork, v).first != home


def test_a_preamble_every_replica_holds_does_not_pull_new_sessions_together() -> None:
    p, v = policy(4)
    for i in range(4):  # every replica holds the preamble and a measured conversation
        p.placed(turn(f"seed{i}", (*PREAMBLE, 3000 + i), 0), rid(i))
        p.placed(turn(f"seed{i}", (*PREAMBLE, 3000 + i, 3100 + i), 1), rid(i))
    homes = [serve(p, turn(f"new{s}", (*PREAMBLE, 4000 + s), 0), v) for s in range(8)]
    assert max(homes.count(rid(i)) for i in range(4)) <= 3, homes
    assert len(set(homes)) >= 3, homes


def _resume_after_forks_with_backlog(backlog_blocks: int, live: int = 0) -> bool:
    """Forks of a 40-block history (20K tokens) make its branch point hot; then the
    history's replica gets `backlog_blocks` of prefill queued (under the load bound) and
    `live` other conversations of three turns (four blocks more each turn). Does the
    parent's resume still go there?"""
    p, v = policy(8)
    _warm(p, v, sessions=8, turns=2, grow=1)
    history = tuple(range(1, 41))
    home = serve(p, turn("parent", history, 0), v)
    for k in range(3):
        serve(p, turn(f"child{k}", (*history, 500 + k), 0), v)
    if backlog_blocks:
        p.dispatched(turn("backlog", tuple(range(60_000, 60_000 + backlog_blocks)), 0), home)
    for s in range(live):
        for n in range(3):
            grown = tuple(range(80_000 + 100 * s, 80_000 + 100 * s + 4 * n))
            p.placed(turn(f"live{s}", (70_000 + s, *grown), n), home)
    assert not p._over_queue(home, metered(v))
    return p.choose(turn("resume", (*history, 600), 0), v).first == home


def test_a_queue_longer_than_the_prefix_it_saves_spreads_the_resume() -> None:
    # 30K tokens queued ahead on the history's replica against a 20K-token recompute.
    assert not _resume_after_forks_with_backlog(60)


def test_a_queue_shorter_than_the_prefix_keeps_the_resume_home() -> None:
    # The control: 10K tokens queued there, less than recomputing the history.
    assert _resume_after_forks_with_backlog(20)


def test_a_sticky_ranking_walks_the_ring_clockwise_from_the_session() -> None:
    # The failover order behind a sticky replica: the ring's distinct members clockwise
    # from the session's key, those in the view, the sticky one first; with one replica,
    # and with a ring member missing from the view (the walk must still end).
    for n, drop in ((1, None), (3, None), (20, None), (3, 1)):
        states = replicas(n)
        p = Lineage(LineageConfig(), PolicyContext(states))
        shown = tuple(r for i, r in enumerate(states) if i != drop)
        v = view(shown)
        req = turn("s", (1, 2, 3), 0)
        home = serve(p, req, v)
        ranked = p.choose(turn("s", (1, 2, 3, 4), 1), v).ranked
        ring = HashRing((RingNode(r.id, r.weight) for r in states), LineageConfig().vnodes)
        walk = [r for r in ring.walk("s") if r != home and r in v.by_id]
        assert ranked == ((home, *walk)[:RANK_DEPTH])
        assert len(ranked) == min(RANK_DEPTH, len(shown))


def _second_rag_session_home(
    capacity_tokens: int, gap_s: float, kv_usage: float = 0.1
) -> tuple[ReplicaId, ReplicaId]:
    """Session a opens with 10 blocks of documents on its replica, which then gets 20K
    tokens of prefill queued; every other replica prefilled 5K tokens of other prompts; a
    comes back after `gap_s`. A new session opening with the same documents: where does
    it go, and where were they?"""
    states = replicas(8, kv_capacity_tokens=capacity_tokens)
    p = Lineage(LineageConfig(), PolicyContext(states))
    v = view(states, default_load=load(kv=kv_usage))
    docs = tuple(range(3000, 3010))
    home = serve(p, turn("a", (*docs, 1), 0), v)
    p.dispatched(turn("backlog", tuple(range(60_000, 60_040)), 0), home)
    for i, r in enumerate(states):
        if r.id != home:
            filler = turn(f"filler{i}", tuple(range(80_000 + 100 * i, 80_010 + 100 * i)), 0)
            p.dispatched(filler, r.id)
            p.prefilled(filler)
    later = dataclasses.replace(v, now=v.now + gap_s)
    assert serve(p, turn("a", (*docs, 1, 2), 1), later) == home
    chosen = p.choose(turn("b", (*docs, 9), 0), later)
    assert chosen.first is not None
    return chosen.first, home


def test_a_new_session_leaves_a_queue_for_documents_cheap_to_recompute() -> None:
    # KV far from full everywhere (at most 26K tokens taken in over 4M), recomputing 5K tokens of
    # documents elsewhere costs each token once plus 1/8 of the cluster's lost work: 6K,
    # less than waiting behind 20K queued.
    chosen, home = _second_rag_session_home(4_000_000, gap_s=30.0)
    assert chosen != home


def test_under_kv_pressure_a_new_session_follows_its_documents() -> None:
    # The control: every replica took in more than its KV holds, so a copy elsewhere
    # evicts what others come back for and a recomputed token weighs cache_weight (16).
    chosen, home = _second_rag_session_home(4_000, gap_s=30.0)
    assert chosen == home


def test_kv_that_running_requests_hold_is_not_room_for_the_cache() -> None:
    # The same large KV, but running requests hold all but 0.1% of it on every replica
    # (the engines' KV usage): the 5K tokens each replica took in fill what is left.
    chosen, home = _second_rag_session_home(4_000_000, gap_s=30.0, kv_usage=0.999)
    assert chosen == home


def test_before_a_gap_is_measured_a_new_session_follows_its_documents() -> None:
    # The other control: a session that came back at once measures no gap, so the
    # policy knows nothing of how long prefixes must live and keeps the full weight.
    chosen, home = _second_rag_session_home(4_000_000, gap_s=0.0)
    assert chosen == home


def test_a_deep_history_does_not_pull_onto_a_replica_crowded_with_live_sessions() -> None:
    # 20 conversations there, each measured to send about two more turns of four blocks:
    # far more work than the 20K-token history saves, so the band spreads the resume
    # (one agent kind no longer piles onto the replica holding its preamble).
    assert not _resume_after_forks_with_backlog(0, live=20)


def test_a_deep_history_pulls_when_its_replica_carries_few_sessions() -> None:
    # The control: the same burst with no extra sessions there.
    assert _resume_after_forks_with_backlog(0)
