"""`pools:` settings section: card pools, model placement, routing rules, weight controller.

Cross-references (a model naming an unknown pool, a rule preferring one, an alias shadowing a
served name) are checked here so that `kvgate check-config` reports them with a dotted key,
long before a request could be misrouted.
"""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.types import Role

DEFAULT_SLOTS_PER_REPLICA = 32


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PoolSpec(_Frozen):
    """One named group of replicas on the same kind of card."""

    name: str = Field(min_length=1, description="pool name; replicas join it with `pool: <name>`")
    hardware: str = Field("", description="card label, e.g. 'H200' or 'Ascend 910C'")
    origin: str = Field("any", description="'imported', 'domestic' or any operator label")
    price_per_card_hour: float = Field(0.0, ge=0.0, description="what one card costs per hour")
    cards_per_replica: int = Field(1, ge=1, description="cards one engine replica occupies")
    capabilities: frozenset[str] = Field(
        frozenset(), description="what the cards can run, e.g. fp8, fp4"
    )
    max_context: int | None = Field(None, ge=1, description="longest context a replica holds")
    role: Role | None = Field(None, description="PD role of the whole pool, if it has one")
    slots_per_replica: int = Field(
        DEFAULT_SLOTS_PER_REPLICA,
        ge=1,
        description="sequences a replica runs before latency suffers: utilisation 1.0",
    )

    @property
    def price_per_replica_hour(self) -> float:
        return self.price_per_card_hour * self.cards_per_replica


class ModelPlacement(_Frozen):
    """Where one served model may run. Empty `pools` and `requires` means anywhere."""

    name: str = Field(min_length=1, description="model name the engines serve")
    aliases: tuple[str, ...] = Field((), description="public names clients may send instead")
    pools: tuple[str, ...] = Field((), description="pools allowed outright (empty: any)")
    requires: frozenset[str] = Field(
        frozenset(), description="capabilities every serving pool must have"
    )
    min_context: int | None = Field(
        None, ge=1, description="pools whose max_context is smaller are excluded"
    )


class PoolRule(_Frozen):
    """Send a priority class and/or tenant to preferred pools, in order.

    A rule naming a tenant outranks one naming only a class; among equals the first listed
    wins. A saturated preferred pool is skipped, so a rule never causes overload.
    """

    priority_class: str | None = Field(None, description="matches RouteRequest.priority_class")
    tenant: str | None = Field(None, description="matches RouteRequest.tenant")
    prefer: tuple[str, ...] = Field(min_length=1, description="pool names, most preferred first")

    @model_validator(mode="after")
    def _needs_a_match(self) -> Self:
        if self.priority_class is None and self.tenant is None:
            raise ValueError("a rule needs priority_class and/or tenant")
        return self

    @property
    def specificity(self) -> int:
        return (2 if self.tenant is not None else 0) + (1 if self.priority_class else 0)


class ControllerSettings(_Frozen):
    """Dynamic weight controller. Utilisations are fractions of a pool's slots (0..1+)."""

    enabled: bool = Field(True, description="false keeps the initial weights (a static split)")
    interval_s: float = Field(5.0, gt=0.0, description="seconds between controller steps")
    low_watermark: float = Field(
        0.5, ge=0.0, le=1.0, description="below this, the cheaper pool gets more traffic"
    )
    high_watermark: float = Field(
        0.8, gt=0.0, le=2.0, description="above this, traffic moves back off a pool"
    )
    hysteresis: float = Field(
        0.05, ge=0.0, le=0.5, description="extra margin needed to reverse the last move"
    )
    dwell_steps: int = Field(
        2,
        ge=1,
        description="consecutive steps an under-used cheaper pool must be seen "
        "before each move of traffic onto it (the count restarts after every move)",
    )
    relieve_dwell_steps: int = Field(
        1,
        ge=1,
        description="consecutive steps a pool must be above the high watermark "
        "before traffic moves off it (overload costs latency now, idleness only money)",
    )
    return_dwell_steps: int = Field(
        5,
        ge=1,
        description="consecutive steps a pool the last move relieved must look "
        "under-used before traffic moves back onto it: weights steer new sessions only, so "
        "its utilisation lags the move",
    )
    max_step: float = Field(0.1, gt=0.0, le=1.0, description="most weight moved per step")
    smoothing: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="weight of the newest utilisation sample in the "
        "moving average the controller decides on (1 = no smoothing)",
    )
    min_weight: float = Field(
        0.0, ge=0.0, lt=1.0, description="floor for every pool's weight (keeps caches warm)"
    )
    ttft_target_s: float | None = Field(
        None,
        gt=0.0,
        description="first-byte time a pool should keep: its recent TTFT "
        "quantile counts as utilisation, reaching the high watermark at this target (unset: "
        "slot-based utilisation only)",
    )
    ttft_quantile: float = Field(
        0.9, gt=0.0, le=1.0, description="which quantile of recent first-byte times counts"
    )
    ttft_max_uncached_tokens: int | None = Field(
        None,
        ge=0,
        description="only requests whose uncached prompt (prompt minus cached "
        "tokens, from the response usage) is at most this many tokens feed the TTFT quantile: "
        "their first byte measures queueing, a cold prompt's mostly its own prefill (unset: "
        "every successful request)",
    )
    ttft_window_s: float = Field(
        10.0, gt=0.0, description="seconds of first-byte times the quantile is taken over"
    )
    saturation: float = Field(
        0.95,
        gt=0.0,
        le=4.0,
        description="at this utilisation a pool counts as saturated: "
        "sessions placed on it may move",
    )

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.low_watermark >= self.high_watermark:
            raise ValueError("low_watermark must be below high_watermark")
        return self


class WarmMoveSettings(_Frozen):
    """Moving a placed session to the pool the weights now give it, its prefix first.

    After a turn succeeds on a pool the weights no longer give the session, the gateway
    sends the same prompt (at most one generated token) to an idle replica of that pool in
    the background, then records the session there. The next turn finds its prefix cached on
    the new pool instead of paying a cold prefill; a session whose warm-up fails stays put.
    """

    enabled: bool = Field(False, description="move placed sessions by warming their prefix")
    max_prompt_tokens: int = Field(
        32768,
        ge=1,
        description="longer prompts (estimated tokens) are not warmed; with "
        "slice_tokens 0 a live request reaching the target replica during the warm-up waits "
        "for its whole prefill, so this bounds that wait",
    )
    min_interval_s: float = Field(
        60.0, ge=0.0, description="a session moves at most once per this many seconds"
    )
    max_concurrent: int = Field(
        4, ge=1, description="warm-ups in flight at once, gateway-wide (one per replica)"
    )
    slice_tokens: int = Field(
        512,
        ge=0,
        description="prefill the prompt in growing prefixes of about this many more "
        "tokens each, sending the next only while the replica has no live request, so a live "
        "turn waits behind one slice at most, not the whole warm-up (0: one request)",
    )
    pricier_only_under_pressure: bool = Field(
        True,
        description="move a session onto a pool with a higher price per replica-hour "
        "only while its own pool's utilisation is at or above the controller's high "
        "watermark: otherwise the move pays a prefill on the pricier cards for no latency "
        "gain, and the session soon moves back once the weights catch up with the load",
    )
    timeout_s: float = Field(120.0, gt=0.0, description="a warm-up taking longer is abandoned")
    retry_s: float = Field(
        10.0,
        ge=0.0,
        description="when no replica of the target pool is idle as a turn ends, "
        "keep looking this long (a user reading the answer leaves time; 0: do not wait)",
    )
    max_waiting: int = Field(
        64,
        ge=1,
        description="sessions waiting for an idle replica at once (each holds its "
        "last request body)",
    )


class PoolsSettings(_Frozen):
    """`pools:` section of the gateway config."""

    pools: tuple[PoolSpec, ...] = Field(min_length=1)
    models: tuple[ModelPlacement, ...] = ()
    rules: tuple[PoolRule, ...] = ()
    controller: ControllerSettings = Field(default_factory=ControllerSettings)
    initial_weights: dict[str, float] = Field(
        default_factory=dict, description="pool -> starting share (default: equal)"
    )
    session_memory: int = Field(
        65536, ge=0, description="sessions whose pool the selector remembers (LRU)"
    )
    strict_models: bool = Field(
        False, description="answer 404 for models not listed under `models`"
    )
    session_idle_release_s: float | None = Field(
        None,
        gt=0.0,
        description="a session idle this many seconds may leave a pool the "
        "weights no longer give it: by then its KV prefix is likely evicted, so stickiness "
        "saves little (unset: sessions move only when their pool saturates)",
    )
    warm_moves: WarmMoveSettings = Field(default_factory=WarmMoveSettings)
    new_sessions_pool: str | None = Field(
        None,
        description="pool where a new session's first turn (its one fully uncached "
        "prefill) runs while that pool is not saturated, e.g. the fast cards; with "
        "warm_moves on, the session then follows the weights with its prefix warmed on the "
        "way (unset: new sessions follow the weights)",
    )
    spill_new_sessions_at: int | None = Field(
        None,
        ge=1,
        description="a new session (no prefix cached anywhere yet) whose weighted "
        "pool has this many requests in flight on every replica goes to an allowed pool with "
        "a replica below it, and to that replica: its first, uncached prefill does not queue "
        "behind another (unset: new sessions follow the weights only)",
    )

    @model_validator(mode="after")
    def _cross_references(self) -> Self:
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique, got {names}")
        known = set(names)
        public: dict[str, str] = {}
        for i, model in enumerate(self.models):
            for pool in model.pools:
                if pool not in known:
                    raise ValueError(f"models[{i}] ({model.name}): unknown pool {pool!r}")
            for name in (model.name, *model.aliases):
                if name in public and public[name] != model.name:
                    raise ValueError(
                        f"models[{i}]: name {name!r} already belongs to model {public[name]!r}"
                    )
                public[name] = model.name
            if not any(eligible(spec, model) for spec in self.pools):
                raise ValueError(
                    f"models[{i}] ({model.name}): no configured pool satisfies pools="
                    f"{list(model.pools)}, requires={sorted(model.requires)}, "
                    f"min_context={model.min_context}"
                )
        if self.new_sessions_pool is not None and self.new_sessions_pool not in known:
            raise ValueError(f"new_sessions_pool: unknown pool {self.new_sessions_pool!r}")
        for i, rule in enumerate(self.rules):
            for pool in rule.prefer:
                if pool not in known:
                    raise ValueError(f"rules[{i}]: unknown pool {pool!r}")
        for pool, weight in self.initial_weights.items():
            if pool not in known:
                raise ValueError(f"initial_weights: unknown pool {pool!r}")
            if weight < 0:
                raise ValueError(f"initial_weights.{pool}: must be >= 0")
        if self.initial_weights and sum(self.initial_weights.values()) <= 0:
            raise ValueError("initial_weights must not all be zero")
        return self

    def pool(self, name: str) -> PoolSpec | None:
        for spec in self.pools:
            if spec.name == name:
                return spec
        return None


def eligible(pool: PoolSpec, model: ModelPlacement) -> bool:
    """Whether `pool` may serve `model` at all. Unknown max_context never satisfies a minimum."""
    if model.pools and pool.name not in model.pools:
        return False
    if not model.requires <= pool.capabilities:
        return False
    if model.min_context is not None:
        return pool.max_context is not None and pool.max_context >= model.min_context
    return True
