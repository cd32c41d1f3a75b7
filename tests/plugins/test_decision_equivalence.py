"""The sublinear `choose` of prefix_affinity and least_load against the straightforward
per-replica algorithms they replaced (kept below as test-only reference code): on
randomized views the failover head and the reason must be identical."""

from __future__ import annotations

import heapq
import random

import pytest
from policy_views import NOW, request

from gateway.policy import RANK_DEPTH, PolicyContext, build_policy
from gateway.types import Choice, ClusterView, EngineLoad, ReplicaId, ReplicaState, RouteRequest
from plugins.least_load import LeastLoad
from plugins.load_model import MASK64, TIE_MULTIPLIER, load_terms, mix
from plugins.prefix_affinity import PrefixAffinity

_ELIGIBLE, _OVERLOADED, _UNKNOWN = 0, 1, 2


def reference_prefix_affinity(p: PrefixAffinity, req: RouteRequest, view: ClusterView) -> Choice:
    """Every replica probed, loaded, scored and ranked one by one."""
    cfg = p.config
    ids = [r.id for r in view.replicas]
    hashes = req.prefix_hashes
    bt = req.block_tokens or 1
    span = len(hashes) * bt
    prompt = max(req.prompt_tokens, span)
    tail = prompt - span
    for r in view.replicas:  # as the old per-view snapshot did before matching
        if r.load is not None and r.load.kv_capacity_tokens and r.id not in p._configured:
            p.index.set_capacity(r.id, r.load.kv_capacity_tokens, bt)
    inflight = [view.in_flight.get(rid, 0) for rid in ids]
    ww = cfg.weights.waiting
    loads: list[float | None] = []
    for r, n in zip(view.replicas, inflight):
        if r.load is None or view.now - r.load.scraped_at > view.stale_after:
            loads.append(None)
            continue
        reported, value = load_terms(r.load, cfg.weights)
        if n > reported:
            value += ww * (n - reported)
        loads.append(value / (r.weight if r.weight > 0 else 1.0))
    matched = [p.index.matched(rid, hashes) if hashes else 0 for rid in ids]
    known = [x for x in loads if x is not None]
    if not known:
        loads = [ww * n for n in inflight]
        known = [x for x in loads if x is not None]
    mean = sum(known) / len(known)
    limit = mean * cfg.overload_factor + cfg.overload_slack
    min_load = min(known)
    k = max(2, int(cfg.shared_quorum * len(matched)) + 1)
    holders = [m for m in matched if m]
    common = heapq.nlargest(k, holders)[-1] if len(holders) >= k else 0
    need = cfg.min_match_fraction * min(prompt, span) if span else 1
    unit = p.unit_tokens
    tiers: list[int] = []
    scores: list[float] = []
    useful_any = shed = False
    followed: set[int] = set()
    for i, load in enumerate(loads):
        if load is None:
            tiers.append(_UNKNOWN)
            scores.append(-float(inflight[i]))
            continue
        if load > limit:
            tiers.append(_OVERLOADED)
            scores.append(-load)
            shed = shed or (matched[i] > common and matched[i] * bt >= need)
            continue
        useful = (matched[i] - common) * bt
        if useful <= 0 or matched[i] * bt < need:
            useful = 0
        else:
            useful_any = True
            if tail and matched[i] == len(hashes):
                useful += tail
            followed.add(i)
        tiers.append(_ELIGIBLE)
        scores.append(cfg.match_weight * useful - cfg.load_weight * unit * (load - min_load))
    sh = p._tie.session_hash(req.session_key)
    keys = [
        (tier, -score, ((sh ^ p._tie.replica_hash(rid)) * TIE_MULTIPLIER) & MASK64)
        for tier, score, rid in zip(tiers, scores, ids)
    ]
    order = sorted(range(len(ids)), key=keys.__getitem__)[:RANK_DEPTH]
    ranked = [ids[i] for i in order]
    if useful_any:
        reason = "prefix_match" if order[0] in followed else "load"
    else:
        eligible = [rid for rid, tier in zip(ids, tiers) if tier == _ELIGIBLE]
        home = p._ring_home(req.session_key, ids, eligible)
        if home is not None:
            if home in ranked:
                ranked.remove(home)
            ranked.insert(0, home)
            reason = "shed" if shed else "ring"
        else:
            reason = "least_loaded"
    return Choice(tuple(ranked), reason, p.name)


def reference_least_load(p: LeastLoad, req: RouteRequest, view: ClusterView) -> Choice:
    sh = p._tie.session_hash(req.session_key)
    keyed = []
    for r in view.replicas:
        n = view.in_flight.get(r.id, 0)
        weight = r.weight if r.weight > 0 else 1.0
        rh = p._tie.replica_hash(r.id)
        if r.load is None or view.now - r.load.scraped_at > view.stale_after:
            keyed.append((1, n / weight, mix(sh, rh), r.id))
            continue
        reported, value = load_terms(r.load, p.config.weights)
        if n > reported:
            value += p.config.weights.waiting * (n - reported)
        keyed.append((0, value / weight, mix(sh, rh), r.id))
    keyed.sort()
    keyed = keyed[:RANK_DEPTH]
    return Choice(
        tuple(k[3] for k in keyed), "unknown_load" if keyed[0][0] else "least_load", p.name
    )


def random_view(rng: random.Random, states: tuple[ReplicaState, ...]) -> ClusterView:
    ties = rng.random() < 0.3  # small integer loads: many exact ties in load and score
    unknown = rng.choice([0.0, 0.0, 0.05, 0.5, 1.0])
    built = []
    for r in states:
        lo: EngineLoad | None = None
        if rng.random() >= unknown:
            age = 5.0 if rng.random() < 0.1 else rng.random()  # some stale (> stale_after)
            lo = EngineLoad(
                waiting=rng.randint(0, 3 if ties else 8),
                running=rng.randint(0, 4 if ties else 16),
                kv_usage=None if ties else rng.random(),
                kv_capacity_tokens=rng.choice([None, None, 16 * rng.randint(20, 400)]),
                scraped_at=NOW - age,
            )
        weight = rng.choice([1.0, 1.0, 1.0, 0.5, 2.0, 0.0])
        built.append(ReplicaState(r.id, r.url, weight=weight, load=lo))
    inflight = {r.id: rng.randint(0, 12) for r in states if rng.random() < 0.7}
    return ClusterView(tuple(built), now=NOW, stale_after=2.0, in_flight=inflight)


CONFIGS: list[dict[str, object]] = [
    {},
    {"load_weight": 0.0},
    {"min_match_fraction": 0.0, "shared_quorum": 0.0},
    {"default_capacity_tokens": 16 * 60, "overload_slack": 0.0},
]


@pytest.mark.parametrize("seed", range(8))
def test_prefix_affinity_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.choice([8, 9, 17, 64, 200, 600]) if seed < 6 else rng.randint(8, 600)
    states = tuple(ReplicaState(ReplicaId(f"r{i}"), f"http://h{i}") for i in range(n))
    policy = build_policy(
        "prefix_affinity", CONFIGS[seed % len(CONFIGS)], PolicyContext(replicas=states)
    )
    assert isinstance(policy, PrefixAffinity)
    system = [rng.getrandbits(62) for _ in range(rng.randint(1, 12))]
    convs: list[list[int]] = []
    # Warm the index: the shared prompt on many replicas, conversations on a few.
    for r in states:
        if rng.random() < 0.6:
            policy.placed(request("warm", system), r.id)
    reasons = set()
    view = random_view(rng, states)
    for step in range(150):
        if step % 30 == 0:
            view = random_view(rng, states)
        if not convs or rng.random() < 0.3:
            convs.append(system + [rng.getrandbits(62) for _ in range(rng.randint(0, 40))])
        conv = rng.randrange(len(convs))
        blocks = convs[conv]
        blocks.extend(rng.getrandbits(62) for _ in range(rng.randint(0, 20)))
        req = request(f"s{conv}", blocks[: rng.choice([len(blocks), 64])])
        if rng.random() < 0.3:
            req = RouteRequest(
                req.request_id,
                req.model,
                req.session_key,
                prefix_hashes=req.prefix_hashes,
                block_tokens=16,
                prompt_tokens=len(req.prefix_hashes) * 16 + rng.randint(1, 900),
            )
        want = reference_prefix_affinity(policy, req, view)
        got = policy.choose(req, view)
        assert got == want, (step, got, want)
        reasons.add(got.reason)
        # Place on the chosen replica mostly, elsewhere sometimes (spreads matches).
        target = want.first if rng.random() < 0.7 else rng.choice(states).id
        assert target is not None
        policy.placed(req, target)
    assert reasons - {"ring"}, reasons  # more than the trivial path was compared


@pytest.mark.parametrize("seed", range(6))
def test_least_load_matches_reference(seed: int) -> None:
    rng = random.Random(100 + seed)
    n = rng.randint(8, 600)
    states = tuple(ReplicaState(ReplicaId(f"r{i}"), f"http://h{i}") for i in range(n))
    policy = build_policy("least_load", {}, PolicyContext(replicas=states))
    assert isinstance(policy, LeastLoad)
    view = random_view(rng, states)
    for step in range(60):
        if step % 10 == 0:
            view = random_view(rng, states)
        req = request(f"s{rng.randint(0, 1000)}")
        assert policy.choose(req, view) == reference_least_load(policy, req, view), step


def test_reverse_map_follows_evictions_and_forget() -> None:
    rng = random.Random(5)
    states = tuple(ReplicaState(ReplicaId(f"r{i}"), f"http://h{i}") for i in range(20))
    policy = build_policy(
        "prefix_affinity", {"default_capacity_tokens": 16 * 30}, PolicyContext(replicas=states)
    )
    assert isinstance(policy, PrefixAffinity)
    prompts = [[rng.getrandbits(62) for _ in range(rng.randint(1, 25))] for _ in range(40)]
    for _ in range(400):
        policy.placed(request("x", rng.choice(prompts)), rng.choice(states).id)
    policy.membership_changed(states[:15])  # forgets r15..r19
    position = {r.id: i for i, r in enumerate(states)}
    for hashes in prompts:
        sparse = policy.index.matched_sparse(position, hashes)
        dense = {i: policy.index.matched(r.id, hashes) for i, r in enumerate(states)}
        assert sparse == {i: m for i, m in dense.items() if m}
        assert all(i < 15 for i in sparse)
