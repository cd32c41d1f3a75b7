"""The per-request choice between colocated serving and a prefill/decode hand-off. Pure.

Disaggregating pays when a long *uncached* prompt would otherwise stall a decode batch and
its KV is cheap to move. With sticky routing most of a prompt is usually already cached on
the replica the session lives on, so `auto` looks at the uncached part there, and at how
long the prompt's KV would take to cross the link, before paying for a hand-off.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

from gateway.pd.config import ModelPDSettings, PDMode
from gateway.types import ClusterView, Endpoint, ReplicaId, ReplicaState, Role, RouteRequest

CachedTokens = Callable[[ReplicaId], int]

# Reasons, one metric label value each.
NOT_CONFIGURED: Final = "not_configured"
MODE_NEVER: Final = "mode_never"
UNSUPPORTED: Final = "unsupported_request"
SHORT_PROMPT: Final = "prompt_under_one_block"
NO_PD_REPLICAS: Final = "no_pd_replicas"
MODE_ALWAYS: Final = "mode_always"
NO_COLOCATED: Final = "no_colocated_replica"
MOSTLY_CACHED: Final = "uncached_below_threshold"
OVER_BUDGET: Final = "transfer_over_budget"
PREFILL_BUSY: Final = "prefill_replicas_busy"
PAYS: Final = "uncached_long_transfer_cheap"

REASONS: Final = (
    NOT_CONFIGURED,
    MODE_NEVER,
    UNSUPPORTED,
    SHORT_PROMPT,
    NO_PD_REPLICAS,
    MODE_ALWAYS,
    NO_COLOCATED,
    MOSTLY_CACHED,
    OVER_BUDGET,
    PREFILL_BUSY,
    PAYS,
)


@dataclass(frozen=True, slots=True)
class PDDecision:
    disaggregate: bool
    reason: str
    prompt_tokens: int = 0
    uncached_tokens: int = 0
    transfer_s: float = 0.0
    kv_bytes: int = 0
    # The colocated replica with the most of this prompt cached, if any was considered.
    best_colocated: ReplicaId | None = None


def _candidates(view: ClusterView, model: str, role: Role) -> tuple[ReplicaState, ...]:
    return tuple(r for r in view.replicas if r.healthy and r.role is role and r.serves(model))


def prompt_tokens_of(request: RouteRequest) -> int:
    if request.prompt_tokens > 0:
        return request.prompt_tokens
    return len(request.prefix_hashes) * request.block_tokens


# What a client could use to steer an engine (issue 19 defect 7, issue 44 item 7): vLLM's
# KV and encoder-cache connector params (an address the engine connects to), SGLang's
# bootstrap address, pairing key and DP-rank pins (vLLM 0.33 `protocol.py`, SGLang 0.5.23
# `openai/protocol.py`). The gateway's own PD sets the hand-off ones; a client's never reach
# an engine unless `pd.allow_client_fields` says so.
CLIENT_PD_FIELDS = frozenset(
    {
        "kv_transfer_params",
        "ec_transfer_params",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "bootstrap_pair_key",
        "routed_dp_rank",
        "data_parallel_rank",
        "disagg_prefill_dp_rank",
    }
)
# vLLM reads the DP rank from this header as well as from the body.
CLIENT_PD_HEADERS = frozenset({b"x-data-parallel-rank"})


def without_client_pd_fields(body: dict[str, Any]) -> dict[str, Any] | None:
    """`body` without the engine-steering fields, or None when it has none (the usual case)."""
    if CLIENT_PD_FIELDS.isdisjoint(body):
        return None
    return {k: v for k, v in body.items() if k not in CLIENT_PD_FIELDS}


_SPLITTABLE = frozenset((Endpoint.CHAT, Endpoint.COMPLETIONS))


def body_blocker(body: Mapping[str, Any], endpoint: Endpoint) -> str | None:
    """Why this request body cannot be split, or None.

    Only chat and completions are split (the hand-off fields are theirs; embeddings,
    pooling and the like have no decode); several choices per request and bodies that
    already carry hand-off fields (a client doing its own PD) are passed through untouched.
    """
    if endpoint not in _SPLITTABLE:
        return endpoint.value
    for key in ("n", "best_of"):
        value = body.get(key)
        if isinstance(value, int) and value > 1:
            return key
    for key in ("kv_transfer_params", "bootstrap_room", "bootstrap_host"):
        if body.get(key) is not None:
            return key
    return None


def decide(
    cfg: ModelPDSettings | None,
    request: RouteRequest,
    view: ClusterView,
    cached: CachedTokens | None = None,
    *,
    blocker: str | None = None,
    serves_whole: Callable[[ReplicaState], bool] = lambda r: r.role is Role.BOTH,
) -> PDDecision:
    """Colocated or split, and why. O(replicas) calls of `cached`.

    `serves_whole` says which replicas can serve the request colocated (see
    `PDSettings.serves_whole`); the best of them is the one holding most of the prompt.
    """
    if cfg is None:
        return PDDecision(False, NOT_CONFIGURED)
    if cfg.mode is PDMode.NEVER:
        return PDDecision(False, MODE_NEVER)
    if blocker is not None or request.endpoint not in _SPLITTABLE:
        return PDDecision(False, UNSUPPORTED)
    prompt = prompt_tokens_of(request)
    if prompt < request.block_tokens:
        return PDDecision(False, SHORT_PROMPT, prompt_tokens=prompt, uncached_tokens=prompt)
    prefills = _candidates(view, request.model, Role.PREFILL)
    if not prefills or not _candidates(view, request.model, Role.DECODE):
        return PDDecision(False, NO_PD_REPLICAS, prompt_tokens=prompt, uncached_tokens=prompt)

    colocated = tuple(
        r for r in view.replicas if r.healthy and r.serves(request.model) and serves_whole(r)
    )
    best: ReplicaId | None = None
    best_cached = 0
    for replica in colocated:
        hit = min(prompt, max(0, cached(replica.id))) if cached is not None else 0
        if best is None or hit > best_cached:
            best, best_cached = replica.id, hit
    uncached = prompt - best_cached
    # The decode side needs the whole prompt's KV, not just the part prefill computed.
    bytes_per_token = cfg.bytes_per_token() or 0
    transfer_s = cfg.transfer_seconds(prompt)
    facts = PDDecision(
        False,
        "",
        prompt_tokens=prompt,
        uncached_tokens=uncached,
        transfer_s=transfer_s,
        kv_bytes=prompt * bytes_per_token,
        best_colocated=best,
    )
    if cfg.mode is PDMode.ALWAYS:
        return replace(facts, disaggregate=True, reason=MODE_ALWAYS)
    if not colocated:
        return replace(facts, disaggregate=True, reason=NO_COLOCATED)
    if uncached < cfg.min_uncached_tokens:
        return replace(facts, reason=MOSTLY_CACHED)
    if transfer_s * 1000.0 > cfg.max_transfer_ms:
        return replace(facts, reason=OVER_BUDGET)
    if min(view.inflight(r.id) for r in prefills) >= cfg.max_prefill_queue:
        return replace(facts, reason=PREFILL_BUSY)
    return replace(facts, disaggregate=True, reason=PAYS)
