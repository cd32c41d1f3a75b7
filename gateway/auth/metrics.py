"""Usage per key and tenant, and refusals, as Prometheus series."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter

from gateway.auth.principal import Principal


class AuthMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "kvgate_key_requests",
            "Proxied requests per API key, tenant and status class.",
            ["key", "tenant", "status"],
            registry=registry,
        )
        self.tokens = Counter(
            "kvgate_key_tokens",
            "Tokens per API key and tenant, from the engines' usage.",
            ["key", "tenant", "kind"],
            registry=registry,
        )
        self.refusals = Counter(
            "kvgate_auth_refusals",
            "Requests refused by the front door, by reason.",
            ["reason"],
            registry=registry,
        )

        # (key, tenant, status class) -> children: `labels()` costs microseconds per call.
        self._children: dict[tuple[str, str, int], tuple[Any, Any, Any]] = {}

    def record(
        self, principal: Principal, status: int, prompt: int | None, completion: int | None
    ) -> None:
        key, tenant = principal.name, principal.tenant
        children = self._children.get((key, tenant, status // 100))
        if children is None:
            children = self._children[(key, tenant, status // 100)] = (
                self.requests.labels(key, tenant, f"{status // 100}xx"),
                self.tokens.labels(key, tenant, "input"),
                self.tokens.labels(key, tenant, "output"),
            )
        children[0].inc()
        if prompt:
            children[1].inc(prompt)
        if completion:
            children[2].inc(completion)
