"""`admission:` settings section: priority classes, saturation thresholds, queue bounds.

Ranking is expressed in seconds of head start (see `gateway.admission.order`), which keeps
the starvation bound explicit: no waiting request is ever overtaken by one that arrived more
than `aging_bound_s` after it.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_CLASSES = ("interactive", "default", "batch")
# Lower classes stop short of saturation, so a better class finds room at once (the
# "holdback below 100% saturation" that queueing routers are asked for).
DEFAULT_HOLDBACKS = (0.0, 0.1, 0.25)


class PriorityClass(BaseModel):
    """One named class. Classes are listed best first; that order is the class order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    engine_priority: int | None = Field(
        default=None,
        description="vLLM `priority` sent to replicas running --scheduling-policy priority "
        "(lower runs first); default: the class's position in the list",
    )
    holdback: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="share of every saturation threshold kept free for better classes",
    )


class SaturationThresholds(BaseModel):
    """A replica is saturated when any configured threshold is reached (None disables one)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_waiting: float | None = Field(
        default=4.0,
        gt=0,
        description="engine waiting-queue length (scraped, corrected by in-flight)",
    )
    max_kv_usage: float | None = Field(
        default=0.9, gt=0, le=1, description="engine KV-cache usage fraction"
    )
    max_inflight: int | None = Field(
        default=None, ge=1, description="requests the gateway has in flight to the replica"
    )
    max_prompt_tokens: int | None = Field(
        default=None,
        ge=1,
        description="prompt tokens (uncached, predicted) of the gateway's requests in flight "
        "to the replica; bounds how many long prefills share the engine's step budget",
    )
    max_prefill_tokens: int | None = Field(
        default=None,
        ge=1,
        description="uncached prompt tokens per engine step of the gateway's requests still "
        "prefilling (admitted, no first byte yet); about the engine's max_num_batched_tokens. "
        "With a class holdback, lower classes leave part of every step to better ones",
    )
    prefill_chunk_tokens: int | None = Field(
        default=None,
        ge=1,
        description="most tokens one request prefills per engine step (vLLM's "
        "long_prefill_token_threshold); weighs each prefilling request for max_prefill_tokens",
    )

    def held_back(self, holdback: float) -> SaturationThresholds:
        """These thresholds with `holdback` of each kept free (at least one place stays).

        Counts round to the nearest whole place, not down: rounding down made a 10%
        holdback take one of two slots, half the replica, from every lower class.
        """
        if holdback <= 0:
            return self
        keep = 1.0 - holdback

        def places(n: int) -> int:
            return max(1, math.floor(n * keep + 0.5))

        return SaturationThresholds(
            max_waiting=None if self.max_waiting is None else self.max_waiting * keep,
            max_kv_usage=None if self.max_kv_usage is None else self.max_kv_usage * keep,
            max_inflight=(None if self.max_inflight is None else places(self.max_inflight)),
            max_prompt_tokens=(
                None if self.max_prompt_tokens is None else places(self.max_prompt_tokens)
            ),
            max_prefill_tokens=(
                None if self.max_prefill_tokens is None else places(self.max_prefill_tokens)
            ),
            prefill_chunk_tokens=self.prefill_chunk_tokens,
        )


class EnginePrioritySettings(BaseModel):
    """`engine_priority:` (for replicas with `priority_scheduling: true`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    shortest_prefill_first: bool = Field(
        default=True,
        description="within a class, rank requests by the uncached prefill the chosen "
        "replica must compute (the prefix index's estimate), shortest first",
    )
    step_tokens: int = Field(
        default=2048,
        ge=1,
        description="uncached tokens below twice this share the first rank; each doubling "
        "past it is one rank more",
    )
    levels: int = Field(
        default=3,
        ge=1,
        le=64,
        description="ranks per class; the last holds every longer prefill, so a long new "
        "context waits behind short ones only (3 kept #2993's p99 where first come had it)",
    )


def _default_classes() -> tuple[PriorityClass, ...]:
    return tuple(
        PriorityClass(name=n, holdback=h) for n, h in zip(DEFAULT_CLASSES, DEFAULT_HOLDBACKS)
    )


class AdmissionSettings(BaseModel):
    """Priority classes and shortest-remaining-first admission in front of saturated replicas."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(default=False, description="hold requests in the gateway while saturated")
    classes: tuple[PriorityClass, ...] = Field(
        default_factory=_default_classes, min_length=1, description="best class first"
    )
    default_class: str = Field("default", description="class of requests that name none")
    key_classes: dict[str, str] = Field(
        default_factory=dict,
        description="API key (the bearer token) -> class; wins over header and body",
    )
    saturation: SaturationThresholds = Field(default_factory=lambda: SaturationThresholds())
    max_queue: int = Field(default=1024, ge=1, description="waiting requests across all replicas")
    max_wait_s: float = Field(default=30.0, gt=0, description="longest wait before a 429")
    class_head_start_s: float = Field(
        default=4.0, ge=0, description="head start of each class over the next one"
    )
    size_head_start_s: float = Field(
        default=4.0, ge=0, description="head start of the smallest request over one at the work cap"
    )
    backfill_s: float = Field(
        default=0.0,
        ge=0,
        description="how long lighter requests of its class may pass a waiter too heavy for "
        "the prompt-token budget (at most size_head_start_s keeps the aging bound)",
    )
    work_cap_tokens: int = Field(
        default=32768, ge=2, description="predicted work at which the size head start is used up"
    )
    expected_output_cap: int = Field(
        default=1024, ge=1, description="cap on the expected output taken from max_tokens"
    )
    default_expected_output: int = Field(
        default=256,
        ge=0,
        description="expected output when neither max_tokens nor history is known",
    )
    output_token_weight: float = Field(
        default=1.0,
        ge=0,
        description="work of one output token relative to one uncached prompt token",
    )
    learn_tenant_output: bool = Field(
        default=True,
        description="predict output from each tenant's recent completions (parses usage)",
    )
    recheck_interval_s: float = Field(
        default=0.05,
        gt=0,
        description="how often waiting replicas are re-checked for fresh scrapes",
    )
    retry_after_s: float = Field(default=2.0, gt=0, le=60, description="Retry-After on a 429")

    @model_validator(mode="after")
    def _check(self) -> AdmissionSettings:
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"admission class names must be unique, got {names}")
        if self.default_class not in names:
            raise ValueError(f"default_class {self.default_class!r} is not one of {names}")
        unknown = sorted(set(self.key_classes.values()) - set(names))
        if unknown:
            raise ValueError(f"key_classes name unknown classes {unknown}; known: {names}")
        if self.backfill_s > self.size_head_start_s:
            # A later arrival could then overtake a waiter past the aging bound.
            raise ValueError(
                f"backfill_s ({self.backfill_s:g}) must not exceed size_head_start_s "
                f"({self.size_head_start_s:g})"
            )
        return self

    @property
    def aging_bound_s(self) -> float:
        """No waiting request is overtaken by one arriving more than this much later."""
        return self.class_head_start_s * (len(self.classes) - 1) + self.size_head_start_s
