"""Edges of the pure tier parts: what the features read of each API's body, the model
files the classifier refuses, answers the checks must not misread, and rules on fields
the main table leaves out."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.errors import ConfigError
from gateway.tiers.config import Escalation, TierRule
from gateway.tiers.escalate import failed_check, mean_logprob
from gateway.tiers.features import (
    DEFAULT_MODEL,
    FEATURE_NAMES,
    LogisticModel,
    features,
    load_model,
    request_text,
    requested_output,
)
from gateway.tiers.ladder import Ladder, rule_matches, tier_input
from gateway.types import Endpoint
from tests.tiers.test_tiers_rules import chat, model

NAMES = dict(zip(FEATURE_NAMES, range(len(FEATURE_NAMES)), strict=True))


def test_responses_and_completions_bodies_are_read_as_text_and_turns() -> None:
    body = {
        "instructions": "be brief",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "first"}]},
            {"role": "user", "content": "second"},
            "third",
            {"type": "message", "text": "fourth"},
            {"content": [{"type": "input_image", "image_url": "x"}]},
        ],
    }
    text, turns = request_text(body)
    assert text.split("\n") == ["be brief", "first", "second", "third", "fourth"]
    assert turns == 5
    text, turns = request_text({"prompt": ["a", "b", 3]})
    assert (text, turns) == ("a\nb", 3)
    assert request_text({"messages": "not a list", "prompt": 7}) == ("", 0)


def test_each_feature_measures_what_its_name_says() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "é" * 10},
            {"role": "user", "content": "```x```\n```y```\n1+1="},
        ],
        "tools": [{"type": "function"}],
        "response_format": {"type": "json_schema"},
        "max_completion_tokens": 99,
        "max_tokens": 5,
    }
    x = features(body)
    text = "é" * 10 + "\n```x```\n```y```\n1+1="
    assert x[NAMES["log_prompt_tokens"]] == pytest.approx(math.log1p(len(text) / 4))
    assert x[NAMES["turns"]] == 2
    assert x[NAMES["code_blocks"]] == 2
    assert x[NAMES["math_share"]] == pytest.approx(4 / len(text))
    assert x[NAMES["non_ascii_share"]] == pytest.approx(10 / len(text))
    assert x[NAMES["tools"]] == x[NAMES["json_output"]] == 1.0
    # max_completion_tokens is the newer name and wins over max_tokens.
    assert x[NAMES["log_max_tokens"]] == pytest.approx(math.log1p(99))
    assert features({}) == (0.0,) * len(FEATURE_NAMES)
    assert requested_output({"max_tokens": True, "max_output_tokens": 7}) == 7


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"kind": "sklearn-pickle"}, "not a kvgate-tiers-logistic model"),
        ({"features": ["turns"]}, "model features"),
        ({"weights": [1.0]}, "'weights' must be a list of 8 numbers"),
        ({"mean": None}, "'mean' must be a list"),
        ({"scale": [0.0] * len(FEATURE_NAMES)}, "scale must not contain 0"),
    ],
)
def test_a_model_that_does_not_fit_the_features_is_refused(
    change: dict[str, Any], said: str
) -> None:
    with pytest.raises(ConfigError, match=said):
        LogisticModel({**DEFAULT_MODEL, **change})


def test_model_files_that_cannot_be_read_name_the_file(tmp_path: Path) -> None:
    broken = tmp_path / "m.json"
    broken.write_bytes(b"{")
    for path in (broken, tmp_path / "absent.json"):
        with pytest.raises(ConfigError, match=f"cannot read classifier model {path}"):
            load_model(path)


def test_scores_stay_in_0_1_for_any_request_size() -> None:
    steep = LogisticModel({**DEFAULT_MODEL, "weights": [1e6] * len(FEATURE_NAMES)})
    assert steep.score([1e9] * len(FEATURE_NAMES)) == pytest.approx(1.0)
    assert steep.score([-1e9] * len(FEATURE_NAMES)) == pytest.approx(0.0)
    # Standardisation is folded into the weights: (x - mean) / scale.
    shifted = LogisticModel(
        {
            **DEFAULT_MODEL,
            "weights": [1.0] + [0.0] * 7,
            "intercept": 0.0,
            "mean": [3.0] + [0.0] * 7,
            "scale": [2.0] + [1.0] * 7,
        }
    )
    assert shifted.score([3.0] + [9.0] * 7) == pytest.approx(0.5)
    assert shifted.score([5.0] + [0.0] * 7) == pytest.approx(1 / (1 + math.exp(-1)))


def _check(payload: object, request: dict[str, Any] | None = None, **esc: Any) -> str | None:
    raw = payload if isinstance(payload, bytes) else orjson.dumps(payload)
    return failed_check(Escalation(**esc), Endpoint.CHAT, 200, raw, request or {})


def _said(content: str) -> dict[str, Any]:
    return {"choices": [{"message": {"content": content}, "finish_reason": "stop"}]}


def test_answers_the_checks_must_not_misread() -> None:
    schema = {"type": "object", "required": ["a", "b"]}
    asks = {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    assert _check(_said('{"a": 1, "b": 2}'), asks) is None
    assert _check(_said('{"a": 1}'), asks) == "json"
    assert _check(_said("[1, 2]"), asks) == "json"  # an object was asked for
    no_schema = {"response_format": {"type": "json_schema", "json_schema": "x"}}
    assert _check(_said("[1]"), no_schema) is None  # nothing to hold it to but parsing
    assert _check(_said("[1]"), {"response_format": {"type": "json_object"}}) == "json"
    assert _check(_said("I\u2019m sorry, but I can\u2019t do that")) == "refusal"
    assert _check(_said("Sorry to hear it; here is the fix")) is None
    # Not JSON at all, or no choices: an error only when errors escalate.
    assert _check(b"<html>", on_error=True) == "error"
    assert _check(b"<html>", on_error=False) is None
    assert _check({"choices": []}) == "empty"
    assert _check({"choices": []}, checks=("length",)) is None
    # The client's own mistake (4xx but 429) is not escalated: a larger model fails too.
    assert failed_check(Escalation(), Endpoint.CHAT, 400, b"{}", {}) is None
    assert failed_check(Escalation(), Endpoint.CHAT, 429, b"{}", {}) == "error"
    assert failed_check(Escalation(on_error=False), Endpoint.CHAT, 503, b"", {}) is None


def test_mean_logprob_of_chat_and_completions_answers() -> None:
    assert mean_logprob({"content": [{"logprob": -1.0}, {"logprob": -3}, "junk"]}) == -2.0
    assert mean_logprob({"token_logprobs": [None, -0.5, -1.5]}) == -1.0
    assert mean_logprob({"token_logprobs": "x"}) is None
    assert mean_logprob({"content": []}) is None
    assert mean_logprob(None) is None


def test_rules_on_prompt_size_tools_tenants_and_score_bounds() -> None:
    x = tier_input(Endpoint.CHAT, chat(tools=[{"type": "function"}]), tenant="acme")
    assert x.prompt_tokens == 0 and x.tools
    assert rule_matches(TierRule(tier="m", max_prompt_tokens=1), x, None)
    assert not rule_matches(TierRule(tier="m", max_prompt_tokens=0), x, None)
    assert not rule_matches(TierRule(tier="m", min_prompt_tokens=1), x, None)
    assert rule_matches(TierRule(tier="m", tools=True, tenants=("acme",)), x, None)
    assert not rule_matches(TierRule(tier="m", tools=False), x, None)
    assert not rule_matches(TierRule(tier="m", tenants=("other",)), x, None)
    # A score bound with no score (no classifier answer) never matches.
    assert not rule_matches(TierRule(tier="m", max_score=0.5), x, None)
    assert rule_matches(TierRule(tier="m", max_score=0.5), x, 0.49)
    assert not rule_matches(TierRule(tier="m", max_score=0.5), x, 0.5)
    assert not rule_matches(TierRule(tier="m", min_score=0.5), x, None)


def test_spill_stops_at_the_top_tier_and_a_remembered_tier_out_of_range_is_ignored() -> None:
    m = model(classifier=None, rules=[])
    tiers = tuple(t.model_copy(update={"spill_at_inflight": 1}) for t in m.tiers)
    ladder = Ladder(m.model_copy(update={"tiers": tiers}))
    assert ladder.classifier is None and ladder.score(Endpoint.CHAT, chat()) is None
    x = tier_input(Endpoint.CHAT, chat())
    top = ladder.choose(x, None, saturated=lambda tier: True)
    assert (top.tier, top.reason) == ("l", "spill")
    partway = ladder.choose(x, None, saturated=lambda tier: tier.name == "s")
    assert (partway.tier, partway.reason) == ("m", "spill")
    stale = tier_input(Endpoint.CHAT, chat(), remembered=7)
    assert ladder.choose(stale, None).reason == "default"
