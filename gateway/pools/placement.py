"""Which replicas may serve a request's model: alias resolution and placement constraints.

Pure and synchronous. Everything the selector ranks comes out of `Placement.place`, so a
replica in a pool lacking the model's capability can never reach a ranked list, whatever
the load.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import BadRequest, ModelNotFound, NoHealthyReplica
from gateway.pools.config import ModelPlacement, PoolSpec, PoolsSettings, eligible
from gateway.types import ClusterView, ReplicaState


class ContextTooLong(BadRequest):
    code = "context_length_exceeded"


@dataclass(frozen=True, slots=True)
class ModelTarget:
    """A request's model after alias resolution.

    `pools` is None for a model the config does not list (any replica that serves it will
    do); otherwise the pools allowed to serve it.
    """

    requested: str
    served: str
    pools: frozenset[str] | None

    @property
    def declared(self) -> bool:
        return self.pools is not None


class Placement:
    """Resolves aliases and filters a view down to the replicas allowed to serve a model.

    Cost: O(1) resolution, O(replicas) filtering per request.
    """

    def __init__(self, settings: PoolsSettings) -> None:
        self._settings = settings
        self._specs: dict[str, PoolSpec] = {p.name: p for p in settings.pools}
        self._targets: dict[str, ModelTarget] = {}
        for model in settings.models:
            pools = self.eligible_pools(model)
            for name in (model.name, *model.aliases):
                self._targets[name] = ModelTarget(name, model.name, pools)

    def eligible_pools(self, model: ModelPlacement) -> frozenset[str]:
        return frozenset(p.name for p in self._settings.pools if eligible(p, model))

    def resolve(self, model: str) -> ModelTarget | None:
        """The served model for a public name; None when unknown and models are strict."""
        target = self._targets.get(model)
        if target is not None:
            return target
        if self._settings.strict_models:
            return None
        return ModelTarget(model, model, None)

    def served_name(self, model: str) -> str:
        target = self._targets.get(model)
        return target.served if target is not None else model

    def public_models(self) -> tuple[str, ...]:
        return tuple(sorted(self._targets))

    def allows(self, target: ModelTarget, replica: ReplicaState, prompt_tokens: int = 0) -> bool:
        if target.pools is not None and replica.pool not in target.pools:
            return False
        spec = self._specs.get(replica.pool) if replica.pool is not None else None
        if spec is not None and spec.max_context is not None and prompt_tokens > spec.max_context:
            return False
        return replica.serves(target.served)

    def place(
        self, model: str, view: ClusterView, prompt_tokens: int = 0
    ) -> tuple[ModelTarget, tuple[ReplicaState, ...]]:
        """The resolved target and its healthy, allowed replicas (never empty).

        Raises `ModelNotFound` (404) for a model nobody serves, `ContextTooLong` (400) when
        only the prompt length rules every pool out, and `NoHealthyReplica` (503) for a known
        model whose capable replicas are all down.
        """
        target = self.resolve(model)
        if target is None:
            raise ModelNotFound(
                f"The model '{model}' does not exist; known models: "
                f"{', '.join(self.public_models()) or 'none'}",
                param="model",
            )
        healthy = tuple(r for r in view.replicas if r.healthy)
        candidates = tuple(r for r in healthy if self.allows(target, r, prompt_tokens))
        if candidates:
            return target, candidates
        if prompt_tokens and any(self.allows(target, r) for r in healthy):
            raise ContextTooLong(
                f"The prompt of about {prompt_tokens} tokens is longer than the context of "
                f"every pool able to serve model '{model}'",
                param="messages",
            )
        if not target.declared and not any(r.serves(target.served) for r in view.replicas):
            raise ModelNotFound(f"The model '{model}' does not exist", param="model")
        where = f" in pools {', '.join(sorted(target.pools))}" if target.pools is not None else ""
        raise NoHealthyReplica(
            f"No healthy replica{where} can serve model '{model}' right now", param="model"
        )
