"""Wires admission into a gateway app (listed in `gateway.app.FEATURE_INSTALLERS`).

No gate is installed when `admission.enabled` is false, so the proxy's request path keeps
its `state.admission is None` branch and pays nothing. The engine payload (the `priority`
replicas with `priority_scheduling` see, gateway.admission.engine_order) is installed
whenever such a replica is configured or admission is on.
"""

from __future__ import annotations

from gateway.admission.classes import ClassMap
from gateway.admission.engine_order import EnginePayload
from gateway.admission.gate import AdmissionGate
from gateway.hooks import RequestOutcome
from gateway.scrape.scraper import MetricsScraper
from gateway.state import GatewayState
from gateway.types import ReplicaId


class _GateService:
    """Turns waiters away with a 429 when the app shuts down."""

    def __init__(self, gate: AdmissionGate) -> None:
        self._gate = gate

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        self._gate.close()


def detected_direction(state: GatewayState, replica: ReplicaId) -> bool | None:
    """Whether the replica runs larger priorities first: as the engine says of itself
    (SGLang's `/server_info` `schedule_low_priority_values_first`, gateway.facts), else by
    the engine kind its metrics show (SGLang's default is larger first, vLLM's lower
    first); None while unknown."""
    facts = state.extras.get("facts")
    said = facts.runs_higher_first(replica) if facts is not None else None
    if isinstance(said, bool):
        return said
    scraper: MetricsScraper | None = state.extras.get("scrape")
    kind = scraper.kinds.get(replica) if scraper is not None else None
    return {"sglang": True, "vllm": False}.get(kind.value) if kind is not None else None


def install(state: GatewayState) -> None:
    settings = state.settings.admission
    classes = ClassMap.from_settings(settings) if settings.enabled else None
    priority_replicas = frozenset(
        ReplicaId(r.id) for r in state.settings.replicas if r.priority_scheduling
    )
    higher_first = frozenset(
        ReplicaId(r.id) for r in state.settings.replicas if r.runs_higher_first()
    )
    detected = frozenset(
        ReplicaId(r.id)
        for r in state.settings.replicas
        if r.priority_order is None and r.engine.value == "auto"
    )
    if priority_replicas or classes is not None:
        state.payload = EnginePayload(
            state.settings.engine_priority,
            priority_replicas,
            higher_first=higher_first,
            classes=classes,
            cache=state.router,
            detected=detected,
            runs_higher_first=lambda replica: detected_direction(state, replica),
        )
    if not settings.enabled:
        return
    gate = AdmissionGate(
        settings,
        state.cluster.view,
        registry=state.metrics.registry,
        policy=state.router,
        priority_header=state.settings.session.priority_header,
    )
    state.admission = gate
    state.extras["admission"] = gate
    state.services.append(_GateService(gate))
    if settings.learn_tenant_output:

        def observe(outcome: RequestOutcome) -> None:
            request = outcome.request
            if outcome.ok and request is not None and outcome.completion_tokens is not None:
                gate.record_output(request.tenant, outcome.completion_tokens)

        state.observers.append(observe)
