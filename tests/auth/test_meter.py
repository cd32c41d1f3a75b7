"""The auth meter (gateway.auth.meter): what the outcome stage used to do for a key, now
behind the `state.meters` hook: the key's series and its ticket's settlement."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gateway.asgi import Scope
from gateway.auth.config import Limits
from gateway.auth.limiter import LocalCounters, LocalLimiter, Ticket
from gateway.auth.meter import AuthMeter
from gateway.auth.metrics import AuthMetrics
from gateway.auth.principal import Principal
from gateway.hooks import RequestUse
from gateway.scope import PRINCIPAL_KEY, TICKET_KEY, Caller, QuotaCharge

PRINCIPAL = Principal(name="alice", tenant="acme")


def test_the_front_doors_objects_are_what_the_request_path_reads() -> None:
    # Checked by mypy on this file: the stages type the scope entries by these protocols.
    caller: Caller = PRINCIPAL
    assert caller.tenant == "acme"
    charge_type: type[QuotaCharge] = Ticket
    assert charge_type is Ticket


async def _ticket() -> tuple[Ticket, LocalLimiter]:
    limiter = LocalLimiter(LocalCounters(lambda: 6000.0))
    ticket = await limiter.acquire((("key", "k", Limits(output_tokens_per_minute=10_000)),))
    assert isinstance(ticket, Ticket)
    ticket.charge(100, 50)
    return ticket, limiter


def _sample(registry: CollectorRegistry, name: str, labels: dict[str, str]) -> float | None:
    return registry.get_sample_value(name, labels)


@pytest.mark.parametrize(
    ("use", "charged"),
    [
        # The engine's usage is exact, below or above the estimate.
        (RequestUse(200, True, True, {"prompt_tokens": 80, "completion_tokens": 7}), (80, 7)),
        # Answered, usage unknown: the estimate stands.
        (RequestUse(200, True, True, None), (100, 50)),
        # An engine took the prompt, then failed (or the client left): output is what went out.
        (RequestUse(502, False, True, None), (100, 0)),
        # Refused before any engine worked on it: nothing stays charged.
        (RequestUse(503, False, False, None), (0, 0)),
    ],
)
async def test_the_ticket_settles_on_what_the_request_used(
    use: RequestUse, charged: tuple[int, int]
) -> None:
    ticket, _ = await _ticket()
    registry = CollectorRegistry()
    scope: Scope = {PRINCIPAL_KEY: PRINCIPAL, TICKET_KEY: ticket}
    AuthMeter(AuthMetrics(registry))(scope, use)
    assert ticket.charged == charged
    status = f"{use.status // 100}xx"
    labels = {"key": "alice", "tenant": "acme", "status": status}
    assert _sample(registry, "kvgate_key_requests_total", labels) == 1.0


async def test_the_keys_token_series_come_from_the_engines_usage() -> None:
    registry = CollectorRegistry()
    meter = AuthMeter(AuthMetrics(registry))
    usage: dict[str, Any] = {"input_tokens": 30, "output_tokens": 4}  # a Responses answer
    meter({PRINCIPAL_KEY: PRINCIPAL}, RequestUse(200, True, True, usage))
    meter({PRINCIPAL_KEY: PRINCIPAL}, RequestUse(200, True, True, usage))
    key = {"key": "alice", "tenant": "acme"}
    assert _sample(registry, "kvgate_key_tokens_total", {**key, "kind": "input"}) == 60.0
    assert _sample(registry, "kvgate_key_tokens_total", {**key, "kind": "output"}) == 8.0


def test_a_scope_the_front_door_left_empty_is_left_alone() -> None:
    registry = CollectorRegistry()
    AuthMeter(AuthMetrics(registry))({}, RequestUse(200, True, True, {"prompt_tokens": 3}))
    labels = {"key": "alice", "tenant": "acme", "status": "2xx"}
    assert _sample(registry, "kvgate_key_requests_total", labels) is None
