"""`Ladder.choose` checked by invariants over generated requests (hypothesis), not by
examples: whatever the request, the decision names a real tier, says truthfully why, and a
spill only ever climbs past tiers that were saturated."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.tiers.config import Tier, TieredModel
from gateway.tiers.ladder import BATCH_CLASSES, Ladder, TierInput, rule_matches
from gateway.types import Endpoint
from tests.tiers.test_tiers_rules import model

SPILLING = model(
    tiers=[
        {"name": "s", "model": "small", "spill_at_inflight": 2},
        {"name": "m", "model": "medium", "spill_at_inflight": 4},
        {"name": "x", "model": "xl"},
        {"name": "l", "model": "large", "spill_at_inflight": 8},
    ]
)
LADDERS = [Ladder(model()), Ladder(SPILLING)]
CLASSES = ["interactive", "default", *sorted(BATCH_CLASSES)]

inputs = st.builds(
    TierInput,
    endpoint=st.sampled_from(list(Endpoint)),
    prompt_tokens=st.integers(0, 200_000),
    max_tokens=st.none() | st.integers(0, 8000),
    tools=st.booleans(),
    json_output=st.booleans(),
    api_key=st.sampled_from([None, "ci", "other"]),
    tenant=st.sampled_from([None, "acme"]),
    priority_class=st.sampled_from(CLASSES),
    hint=st.sampled_from([None, "s", "m", "l", "x", "nonsense"]),
    remembered=st.none() | st.integers(-2, 5),
)
scores = st.none() | st.floats(0, 1)


def check_names(ladder: Ladder, decision: Any) -> None:
    tier: Tier = ladder.tiers[decision.index]
    assert 0 <= decision.index < len(ladder.tiers)
    assert (decision.tier, decision.model) == (tier.name, tier.model)
    assert decision.public == ladder.config.name


@settings(max_examples=100, deadline=None)
@given(ladder=st.sampled_from(LADDERS), x=inputs, score=scores)
def test_the_entry_tier_follows_the_stated_precedence(
    ladder: Ladder, x: TierInput, score: float | None
) -> None:
    decision = ladder.choose(x, score)
    check_names(ladder, decision)
    config: TieredModel = ladder.config
    first = next((i for i, rule in enumerate(config.rules) if rule_matches(rule, x, score)), None)
    if x.hint in ladder.index_of:
        assert (decision.tier, decision.reason) == (x.hint, "hint")
    elif x.remembered is not None and 0 <= x.remembered < len(ladder.tiers):
        assert (decision.index, decision.reason) == (x.remembered, "sticky")
    elif first is not None:
        assert decision.reason == f"rule:{first}"
        assert decision.tier == config.rules[first].tier
    else:
        assert (decision.index, decision.reason) == (0, "default")
    assert decision.score == score


@settings(max_examples=150, deadline=None)
@given(
    x=inputs,
    score=scores,
    busy=st.frozensets(st.sampled_from(["s", "m", "x", "l"])),
)
def test_a_spill_climbs_only_past_saturated_spilling_tiers_and_never_for_batch(
    x: TierInput, score: float | None, busy: frozenset[str]
) -> None:
    ladder = Ladder(SPILLING)
    asked: list[str] = []

    def saturated(tier: Tier) -> bool:
        asked.append(tier.name)
        return tier.name in busy

    entry = ladder.choose(x, score)
    spilled = ladder.choose(x, score, saturated)
    check_names(ladder, spilled)
    if x.priority_class in BATCH_CLASSES:
        assert spilled == entry and asked == []
        return
    assert spilled.index >= entry.index
    if spilled.index == entry.index:
        assert spilled == entry
    else:
        assert spilled.reason == "spill"
        # Every tier climbed past spills and was saturated; they are the ones asked.
        passed = ladder.tiers[entry.index : spilled.index]
        assert all(t.spill_at_inflight and t.name in busy for t in passed)
        assert asked[: len(passed)] == [t.name for t in passed]
    # It stopped for a reason: the top, a tier that does not spill, or one with room.
    here = ladder.tiers[spilled.index]
    assert (
        spilled.index == len(ladder.tiers) - 1
        or not here.spill_at_inflight
        or here.name not in busy
    )


@settings(max_examples=60, deadline=None)
@given(ladder=st.sampled_from(LADDERS), x=inputs, score=scores)
def test_escalation_climbs_one_tier_at_a_time_to_the_top(
    ladder: Ladder, x: TierInput, score: float | None
) -> None:
    decision = ladder.choose(x, score)
    steps = 0
    while (up := ladder.escalated(decision, "json")) is not None:
        check_names(ladder, up)
        assert up.index == decision.index + 1
        assert (up.reason, up.score, up.sticky_key) == (
            "escalated:json",
            decision.score,
            decision.sticky_key,
        )
        decision, steps = up, steps + 1
    assert decision.index == len(ladder.tiers) - 1
    assert steps == len(ladder.tiers) - 1 - ladder.choose(x, score).index
