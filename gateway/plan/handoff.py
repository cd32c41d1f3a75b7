"""Does a prefill/decode hand-off pay for a prompt of this length over this link?

The answer is the gateway's own `pd.auto` decision (`gateway.pd.decision.decide`) run on a
three-replica view (a prefill, a decode and a colocated replica holding `cached` tokens of
the prompt), so the planner and the live gateway can never disagree. The KV moved is the
prompt's unique KV (one copy of an MLA latent, all KV heads), over the link's total rate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from gateway.pd.config import ModelPDSettings, PDMode
from gateway.pd.decision import PDDecision, decide
from gateway.plan.shapes import ModelShape, ShapeError
from gateway.types import ClusterView, ReplicaId, ReplicaState, Role, RouteRequest, SessionKey

# Gigabit/s.
LINKS: Mapping[str, float] = MappingProxyType(
    {
        "10gbe": 10.0,
        "25gbe": 25.0,
        "100gbe": 100.0,
        "200g-ib": 200.0,
        "400g-ib": 400.0,
        "pcie4": 256.0,  # x16, one direction
        "pcie5": 512.0,
        "nvlink": 7200.0,  # NVLink 4, 900 GB/s
    }
)
_MODEL = "planned"


def link_gbps(spec: str) -> float:
    """'10gbe', 'nvlink', or a number of gigabit/s."""
    key = spec.strip().lower()
    if key in LINKS:
        return LINKS[key]
    try:
        value = float(key.removesuffix("gbps").removesuffix("g"))
    except ValueError:
        raise ShapeError(
            f"unknown link {spec!r}: a number of Gbit/s or one of {', '.join(LINKS)}"
        ) from None
    if value <= 0 or not math.isfinite(value):
        raise ShapeError(f"link speed must be positive: {spec!r}")
    return value


NO_BENEFIT = "no_benefit"


@dataclass(frozen=True, slots=True)
class Handoff:
    prompt_tokens: int
    cached_tokens: int
    link_gbps: float
    kv_bytes: int
    transfer_s: float
    decision: PDDecision
    # What the split saves: the decode stall a colocated prefill of the uncached prompt would
    # cause (its prefill time x the share of it that stalls decoding). None: not weighed.
    benefit_s: float | None = None

    @property
    def outweighed(self) -> bool:
        """The gateway would split, but the stall it saves is no more than the transfer."""
        return self.benefit_s is not None and self.benefit_s <= self.transfer_s

    @property
    def pays(self) -> bool:
        return self.decision.disaggregate and not self.outweighed

    @property
    def reason(self) -> str:
        return (
            NO_BENEFIT if self.decision.disaggregate and self.outweighed else self.decision.reason
        )


def handoff(
    model: ModelShape,
    prompt_tokens: int,
    link: float,
    *,
    kv_dtype: str = "bf16",
    cached_tokens: int = 0,
    pd: ModelPDSettings | None = None,
    kv_bytes_per_token: int | None = None,
    prefill_tokens_per_s: float | None = None,
    interference: float = 1.0,
) -> Handoff:
    """`pd` supplies the auto thresholds (the gateway's defaults when None).

    `kv_bytes_per_token` replaces the model's figure (a compressed KV format moves fewer
    bytes). With `prefill_tokens_per_s`, the split must also save more decode stall than
    the transfer costs: `interference` of the uncached prompt's prefill time (1 for dense
    attention; near 0 where sparse attention or a compressed KV leaves decode unaffected).
    """
    if prompt_tokens < 1:
        raise ShapeError("prompt length must be at least 1 token")
    if not 0 <= interference <= 1:
        raise ShapeError(f"prefill interference is a share, 0 to 1: {interference!r}")
    if kv_bytes_per_token is not None and kv_bytes_per_token < 1:
        raise ShapeError("KV bytes per token must be at least 1")
    whole = model.kv_bytes_per_sequence(prompt_tokens, kv_dtype)
    per_token = kv_bytes_per_token or max(1, math.ceil(whole / prompt_tokens))
    base = pd or ModelPDSettings()
    cfg = base.model_copy(
        update={
            "mode": PDMode.AUTO,
            "kv_bytes_per_token": per_token,
            "attention": None,
            "link_gbps": link,
        }
    )
    replicas = tuple(
        ReplicaState(
            id=ReplicaId(rid), url=f"http://{rid}.invalid", role=role, models=frozenset({_MODEL})
        )
        for rid, role in (
            ("prefill", Role.PREFILL),
            ("decode", Role.DECODE),
            ("colocated", Role.BOTH),
        )
    )
    request = RouteRequest(
        request_id="plan", model=_MODEL, session_key=SessionKey("plan"), prompt_tokens=prompt_tokens
    )
    cached = min(cached_tokens, prompt_tokens)
    decision = decide(
        cfg, request, ClusterView(replicas=replicas), lambda r: cached if r == "colocated" else 0
    )
    benefit = None
    if prefill_tokens_per_s:
        benefit = interference * (prompt_tokens - cached) / prefill_tokens_per_s
    return Handoff(
        prompt_tokens,
        cached,
        link,
        prompt_tokens * per_token,
        cfg.transfer_seconds(prompt_tokens),
        decision,
        benefit,
    )


def transfer_seconds(n_bytes: int, link: float, latency_ms: float = 0.0) -> float:
    """Seconds to move `n_bytes` over `link` Gbit/s: `pd`'s own estimate, one byte a token."""
    cfg = ModelPDSettings(kv_bytes_per_token=1, link_gbps=link, link_latency_ms=latency_ms)
    return cfg.transfer_seconds(n_bytes)
