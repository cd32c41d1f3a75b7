from __future__ import annotations

from collections import Counter

from policy_views import replicas, request, rid, view

from gateway.policy import PolicyContext, build_policy
from plugins.cache_aware import CacheAware


def make(n: int = 4, **cfg: object) -> CacheAware:
    policy = build_policy("cache_aware", cfg, PolicyContext(replicas=replicas(n)))
    assert isinstance(policy, CacheAware)
    return policy


def test_a_prefix_over_the_threshold_goes_where_it_is_cached_however_loaded() -> None:
    policy = make()
    policy.placed(request("a", range(10)), rid(2))
    # Holds 10 of 20 blocks (50% > 30%): r2 wins although it carries 40 requests.
    loaded = view(replicas(4), inflight={2: 40})
    choice = policy.choose(request("b", range(20)), loaded)
    assert (choice.first, choice.reason) == (rid(2), "prefix")
    assert set(choice.ranked) == {rid(i) for i in range(4)}


def test_a_match_under_the_threshold_goes_to_the_fewest_in_flight() -> None:
    policy = make()
    policy.placed(request("a", range(5)), rid(2))
    # 5 of 20 blocks is 25%, under 30%: load decides.
    choice = policy.choose(request("b", range(20)), view(replicas(4), inflight={0: 3, 2: 1, 3: 1}))
    assert (choice.first, choice.reason) == (rid(1), "least_load")
    # Control: the same match over a lower threshold decides.
    low = make(cache_threshold=0.2)
    low.placed(request("a", range(5)), rid(2))
    assert low.choose(request("b", range(20)), view(replicas(4), inflight={0: 3})).first == rid(2)


def test_imbalance_overrides_the_cache() -> None:
    policy = make()
    policy.placed(request("a", range(20)), rid(0))
    spread = view(replicas(4), inflight={0: 100, 1: 10, 2: 20, 3: 30})
    choice = policy.choose(request("a", range(21)), spread)
    assert (choice.first, choice.reason) == (rid(1), "imbalanced")
    # Both thresholds must be crossed: a spread of 64 or less keeps the cache deciding.
    near = view(replicas(4), inflight={0: 70, 1: 10, 2: 20, 3: 30})
    assert policy.choose(request("a", range(21)), near).first == rid(0)


def test_ties_in_load_go_to_the_replica_sent_fewer_requests() -> None:
    policy = make(2)
    policy.placed(request("x", ()), rid(0))
    assert policy.choose(request("new", ()), view(replicas(2))).first == rid(1)


def test_new_prompts_spread_and_each_conversation_follows_its_cache() -> None:
    policy = make(4)
    firsts: Counter[str] = Counter()
    inflight: dict[int, int] = {}
    for s in range(16):
        hashes = [1000 * s + b for b in range(8)]
        choice = policy.choose(request(f"s{s}", hashes), view(replicas(4), inflight=inflight))
        policy.placed(request(f"s{s}", hashes), choice.first)
        index = int(choice.first[1:])
        inflight[index] = inflight.get(index, 0) + 1
        firsts[choice.first] += 1
        # The next turn extends the prompt: it finds its cache.
        longer = request(f"s{s}", [*hashes, *range(10**6, 10**6 + 4)])
        assert policy.choose(longer, view(replicas(4), inflight=inflight)).first == choice.first
    assert sorted(firsts.values()) == [4, 4, 4, 4]


def test_a_removed_replica_is_forgotten() -> None:
    policy = make(3)
    policy.placed(request("a", range(10)), rid(2))
    policy.membership_changed(replicas(2))
    assert policy.cached_tokens(request("a", range(10)), rid(2)) == 0
    choice = policy.choose(request("a", range(10)), view(replicas(2)))
    assert choice.reason == "least_load"
    assert policy.choose(request("a", range(10)), view(())).reason == "no_candidates"
