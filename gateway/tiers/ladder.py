"""`Ladder`: one tiered public name, and the pure choice of the tier a request enters.

Order of precedence: the client's hint header naming a tier, then the tier the
conversation is already on (stickiness, remembered by the runtime), then the rules (first
match wins), then the first tier. A saturated tier then sends interactive requests up
(`spill`); batch classes stay and wait in admission's queue like any other request.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.hashing import CHARS_PER_TOKEN
from gateway.tiers.classify import Classifier, build_classifier
from gateway.tiers.config import Tier, TieredModel, TierRule
from gateway.tiers.features import has_tools, request_text, requested_output, wants_json
from gateway.types import Endpoint, TierDecision

BATCH_CLASSES = frozenset({"batch", "background", "low"})


@dataclass(frozen=True, slots=True)
class TierInput:
    """What the rules read of one request (no text)."""

    endpoint: Endpoint
    prompt_tokens: int
    max_tokens: int | None
    tools: bool
    json_output: bool
    api_key: str | None
    tenant: str | None
    priority_class: str
    hint: str | None = None
    remembered: int | None = None


def tier_input(
    endpoint: Endpoint,
    body: Mapping[str, Any],
    *,
    api_key: str | None = None,
    tenant: str | None = None,
    priority_class: str = "default",
    hint: str | None = None,
    remembered: int | None = None,
) -> TierInput:
    text, _ = request_text(body)
    return TierInput(
        endpoint=endpoint,
        prompt_tokens=len(text) // CHARS_PER_TOKEN,
        max_tokens=requested_output(body),
        tools=has_tools(body),
        json_output=wants_json(body),
        api_key=api_key,
        tenant=tenant,
        priority_class=priority_class,
        hint=hint,
        remembered=remembered,
    )


def rule_matches(rule: TierRule, x: TierInput, score: float | None) -> bool:
    if rule.endpoints and x.endpoint not in rule.endpoints:
        return False
    if rule.min_prompt_tokens is not None and x.prompt_tokens < rule.min_prompt_tokens:
        return False
    if rule.max_prompt_tokens is not None and x.prompt_tokens >= rule.max_prompt_tokens:
        return False
    if rule.min_max_tokens is not None and (x.max_tokens or 0) < rule.min_max_tokens:
        return False
    if rule.tools is not None and x.tools != rule.tools:
        return False
    if rule.response_format is not None and x.json_output != rule.response_format:
        return False
    if rule.api_keys and x.api_key not in rule.api_keys:
        return False
    if rule.tenants and x.tenant not in rule.tenants:
        return False
    if rule.priority_classes and x.priority_class not in rule.priority_classes:
        return False
    if rule.min_score is not None and (score is None or score < rule.min_score):
        return False
    return not (rule.max_score is not None and (score is None or score >= rule.max_score))


class Ladder:
    """The tiers of one public name, its rules and its classifier (built once)."""

    __slots__ = ("classifier", "config", "hint_header", "index_of", "tiers")

    def __init__(self, config: TieredModel, classifier: Classifier | None = None) -> None:
        self.config = config
        self.tiers: tuple[Tier, ...] = config.tiers
        self.index_of = {t.name: i for i, t in enumerate(config.tiers)}
        self.hint_header = config.hint_header.lower().encode("latin-1")
        if classifier is None and config.classifier is not None:
            classifier = build_classifier(config.classifier.name, config.classifier.config)
        self.classifier = classifier

    def score(self, endpoint: Endpoint, body: Mapping[str, Any]) -> float | None:
        if self.classifier is None:
            return None
        return self.classifier.classify(endpoint, body).score

    def choose(
        self,
        x: TierInput,
        score: float | None,
        saturated: Callable[[Tier], bool] | None = None,
    ) -> TierDecision:
        """The entry tier. Pure but for `saturated` (a read of the cluster view)."""
        index, reason = self._entry(x, score)
        if saturated is not None and x.priority_class not in BATCH_CLASSES:
            while index + 1 < len(self.tiers) and self.tiers[index].spill_at_inflight:
                if not saturated(self.tiers[index]):
                    break
                index, reason = index + 1, "spill"
        return self.decision(index, reason, score)

    def _entry(self, x: TierInput, score: float | None) -> tuple[int, str]:
        if x.hint is not None and (hinted := self.index_of.get(x.hint)) is not None:
            return hinted, "hint"
        if x.remembered is not None and 0 <= x.remembered < len(self.tiers):
            return x.remembered, "sticky"
        for i, rule in enumerate(self.config.rules):
            if rule_matches(rule, x, score):
                return self.index_of[rule.tier], f"rule:{i}"
        return 0, "default"

    def decision(
        self, index: int, reason: str, score: float | None, sticky_key: str | None = None
    ) -> TierDecision:
        tier = self.tiers[index]
        return TierDecision(
            self.config.name, index, tier.name, tier.model, reason, score, sticky_key
        )

    def escalated(self, decision: TierDecision, check: str) -> TierDecision | None:
        """The next tier up after `check` failed, or None at the top."""
        index = decision.index + 1
        if index >= len(self.tiers):
            return None
        return self.decision(index, f"escalated:{check}", decision.score, decision.sticky_key)
