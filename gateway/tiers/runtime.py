"""`TiersRuntime`: the ladders, the tier each conversation is on, and the money ledger.

One per gateway (`state.tiers`), built by gateway.tiers.install. The proxy asks it for a
tiered request's entry tier (inbound), whether an answer fails its tier's checks and which
tier comes next (gateway.proxy.tiered), and tells it what each attempt served.

Stickiness: a conversation is named by the client's session header, else by a digest of
its opening messages (every system message before the first user message, and that one),
which every later turn repeats. Its tier is remembered (an LRU of `sticky_sessions`) when
an answer goes out; an escalated conversation is remembered on the tier it escalated to.
The memory is per gateway process, like `LocalPlacements`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from gateway.hashing import digest_hex
from gateway.tiers.config import Tier, TiersSettings
from gateway.tiers.escalate import failed_check
from gateway.tiers.ladder import Ladder, tier_input
from gateway.tiers.metrics import TierLedger
from gateway.types import ClusterView, Endpoint, TierDecision
from gateway.usage import usage_tokens

RawHeaders = Sequence[tuple[bytes, bytes]]


def conversation_opening(body: Mapping[str, Any]) -> list[Any] | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    for i, message in enumerate(messages):
        if isinstance(message, Mapping) and message.get("role") == "user":
            return messages[: i + 1]
    return None


def conversation_key(public: str, body: Mapping[str, Any], session: str | None) -> str | None:
    if session:
        return f"{public}|s:{session}"
    opening = conversation_opening(body)
    if opening is None:
        return None
    return f"{public}|c:{digest_hex(orjson.dumps(opening))}"


class TiersRuntime:
    def __init__(
        self,
        settings: TiersSettings,
        view: Callable[[], ClusterView],
        served_name: Callable[[str], str] | None = None,
        ladders: Mapping[str, Ladder] | None = None,
    ) -> None:
        self.settings = settings
        self.ladders: dict[str, Ladder] = dict(ladders or {})
        for model in settings.models:
            self.ladders.setdefault(model.name, Ladder(model))
        self._view = view
        self._served = served_name
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._capacity = settings.sticky_sessions
        self.ledger = TierLedger()

    def ladder(self, model: str) -> Ladder | None:
        return self.ladders.get(model)

    def entry(
        self,
        model: str,
        endpoint: Endpoint,
        body: Mapping[str, Any],
        headers: RawHeaders,
        *,
        session: str | None = None,
        api_key: str | None = None,
        tenant: str | None = None,
        priority_class: str | None = None,
    ) -> TierDecision | None:
        """The tier a request for `model` enters; None: `model` is no tiered name."""
        ladder = self.ladders.get(model)
        if ladder is None:
            return None
        return self.decide(
            ladder,
            endpoint,
            body,
            headers,
            session=session,
            api_key=api_key,
            tenant=tenant,
            priority_class=priority_class,
        )

    def decide(
        self,
        ladder: Ladder,
        endpoint: Endpoint,
        body: Mapping[str, Any],
        headers: RawHeaders,
        *,
        session: str | None = None,
        api_key: str | None = None,
        tenant: str | None = None,
        priority_class: str | None = None,
    ) -> TierDecision:
        hint: str | None = None
        name = ladder.hint_header
        if name:
            for header, value in headers:
                if header == name:
                    hint = value.decode("latin-1").strip()
                    break
        key = conversation_key(ladder.config.name, body, session) if ladder.config.sticky else None
        remembered = self._sticky.get(key) if key is not None else None
        x = tier_input(
            endpoint,
            body,
            api_key=api_key,
            tenant=tenant,
            priority_class=priority_class or "default",
            hint=hint,
            remembered=remembered,
        )
        score = ladder.score(endpoint, body)
        chosen = ladder.choose(x, score, self._saturated)
        if key is not None:
            chosen = ladder.decision(chosen.index, chosen.reason, score, key)
        kind = chosen.reason.split(":", 1)[0]
        self.ledger.decisions[(chosen.public, chosen.tier, kind)] += 1
        return chosen

    def _saturated(self, tier: Tier) -> bool:
        limit = tier.spill_at_inflight
        if limit is None:
            return False
        model = self._served(tier.model) if self._served is not None else tier.model
        view = self._view()
        serving = [r for r in view.healthy() if r.serves(model)]
        return bool(serving) and all(view.inflight(r.id) >= limit for r in serving)

    def failed(
        self,
        decision: TierDecision,
        endpoint: Endpoint,
        status: int,
        payload: bytes,
        request: Mapping[str, Any],
    ) -> str | None:
        """The check this tier's answer failed (None: it goes out, or the tier never
        escalates, or it is the top tier)."""
        ladder = self.ladders[decision.public]
        escalation = ladder.tiers[decision.index].escalate
        if escalation is None or decision.index + 1 >= len(ladder.tiers):
            return None
        return failed_check(escalation, endpoint, status, payload, request)

    def escalates(self, decision: TierDecision, stream: bool) -> bool:
        """Whether this request's answer is held back to be checked."""
        ladder = self.ladders[decision.public]
        if decision.index + 1 >= len(ladder.tiers):
            return False
        escalation = ladder.tiers[decision.index].escalate
        # Streams: only an error before the first byte, which attempts already see.
        return escalation is not None and (not stream or escalation.on_error)

    def escalate(self, decision: TierDecision, check: str) -> TierDecision | None:
        self.ledger.escalations[(decision.public, decision.tier, check)] += 1
        return self.ladders[decision.public].escalated(decision, check)

    def served(self, decision: TierDecision, usage: Mapping[str, Any] | None, final: bool) -> None:
        """Count one attempt's answer; `final`: the one the client gets."""
        ledger = self.ledger
        ladder = self.ladders[decision.public]
        tier = ladder.tiers[decision.index]
        ledger.requests[(decision.public, tier.name)] += 1
        used_in, _, used_out = usage_tokens(dict(usage) if usage is not None else None)
        prompt, completion = used_in or 0, used_out or 0
        ledger.tokens[(decision.public, tier.name, "prompt")] += prompt
        ledger.tokens[(decision.public, tier.name, "completion")] += completion
        total = prompt + completion
        ledger.cost[(decision.public, tier.name)] += total * tier.price_per_1m_tokens / 1e6
        if final:
            largest = ladder.tiers[-1].price_per_1m_tokens
            ledger.all_largest[decision.public] += total * largest / 1e6
            ledger.answered_tokens[decision.public] += total
            self.remember(decision)

    def remember(self, decision: TierDecision) -> None:
        key = decision.sticky_key
        if key is None:
            return
        sticky = self._sticky
        if sticky.get(key) == decision.index:
            sticky.move_to_end(key)
            return
        sticky[key] = max(decision.index, sticky.get(key, 0))
        sticky.move_to_end(key)
        while len(sticky) > self._capacity:
            sticky.popitem(last=False)
