"""`tiers:` settings section: public model names served by ordered tiers of models.

A tiered name (`auto`, or a served model's own name with `take_over`) maps to tiers, small
first. Rules, first match wins, pick the tier a request enters; no rule matching means the
first tier. Cross-references (a rule naming an unknown tier, a classifier rule without a
classifier) are checked here, so `kvgate check-config` reports them with a dotted key.
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.types import Endpoint

DEFAULT_HINT_HEADER = "x-kvgate-tier"
DEFAULT_STICKY_SESSIONS = 100_000
Check = Literal["length", "content_filter", "json", "empty", "refusal", "logprob"]
CHECKS: tuple[Check, ...] = ("length", "content_filter", "json", "empty", "refusal", "logprob")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Escalation(_Frozen):
    """Check a non-streamed answer of this tier; a failed check re-runs the request on the
    next tier before anything reaches the client. Streams escalate only on an error before
    their first byte."""

    checks: tuple[Check, ...] = Field(CHECKS, description="which checks run: " + ", ".join(CHECKS))
    min_mean_logprob: float = Field(
        -2.5, le=0.0, description="`logprob`: mean token logprob below this fails"
    )
    on_error: bool = Field(True, description="a 5xx or 429 of this tier escalates too")


class Tier(_Frozen):
    """One step of the ladder: a served model, optionally on one pool."""

    name: str = Field(
        min_length=1, description="tier name, e.g. 'small'; sent back in x-kvgate-tier"
    )
    model: str = Field(min_length=1, description="the served model (or a pools alias)")
    pool: str | None = Field(None, description="pool whose replicas serve it (informational)")
    price_per_1m_tokens: float = Field(
        0.0, ge=0.0, description="cost of a million prompt+output tokens on this tier"
    )
    escalate: Escalation | None = Field(None, description="check answers; None: never escalate")
    spill_at_inflight: int | None = Field(
        None,
        ge=1,
        description="interactive requests go up a tier while every healthy replica of this "
        "one has this many requests in flight (None: never spill)",
    )


class TierRule(_Frozen):
    """Enter `tier` when every condition given matches (unset conditions match anything)."""

    tier: str = Field(min_length=1)
    endpoints: tuple[Endpoint, ...] = Field((), description="routes, e.g. embeddings, rerank")
    min_prompt_tokens: int | None = Field(None, ge=0, description="estimated prompt tokens >=")
    max_prompt_tokens: int | None = Field(None, ge=0, description="estimated prompt tokens <")
    min_max_tokens: int | None = Field(None, ge=0, description="requested output tokens >=")
    tools: bool | None = Field(None, description="the request carries tools")
    response_format: bool | None = Field(None, description="the request asks for JSON output")
    api_keys: tuple[str, ...] = Field((), description="names of the caller's API key")
    tenants: tuple[str, ...] = ()
    priority_classes: tuple[str, ...] = ()
    min_score: float | None = Field(None, description="classifier score >= (0..1, 1 = hard)")
    max_score: float | None = Field(None, description="classifier score <")


class ClassifierSpec(_Frozen):
    name: str = Field("features", description="registered classifier or 'module:Class'")
    config: dict[str, Any] = Field(default_factory=dict, description="the classifier's config")


class TieredModel(_Frozen):
    name: str = Field(min_length=1, description="public model name, e.g. 'auto'")
    take_over: bool = Field(
        False, description="the name is also a served model's; requests for it are tiered"
    )
    tiers: tuple[Tier, ...] = Field(min_length=2, description="small first")
    rules: tuple[TierRule, ...] = ()
    classifier: ClassifierSpec | None = None
    hint_header: str = Field(
        DEFAULT_HINT_HEADER, description="a client's request for a tier by name (empty: ignored)"
    )
    sticky: bool = Field(True, description="a conversation stays on its tier (see docs/tiers.md)")

    @model_validator(mode="after")
    def _references(self) -> Self:
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique: {names}")
        served = {t.model for t in self.tiers}
        if self.name in served and not self.take_over:
            raise ValueError(
                f"{self.name!r} is a tier's served model: set take_over: true to tier it"
            )
        for i, rule in enumerate(self.rules):
            if rule.tier not in names:
                raise ValueError(f"rules[{i}].tier {rule.tier!r} is not one of {names}")
            scored = rule.min_score is not None or rule.max_score is not None
            if scored and self.classifier is None:
                raise ValueError(f"rules[{i}] uses a score but no classifier is configured")
        return self


class TiersSettings(_Frozen):
    models: tuple[TieredModel, ...] = Field(min_length=1)
    sticky_sessions: int = Field(
        DEFAULT_STICKY_SESSIONS, ge=1, description="conversations whose tier is remembered (LRU)"
    )

    @model_validator(mode="after")
    def _unique(self) -> Self:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"tiered model names must be unique: {names}")
        return self
