"""What a diagnosis says: a finding (the replica, what was seen with its numbers, the
setting that would change it) and the hints an operator passes for what engines do not show.
`severe` findings make `kvgate doctor` exit non-zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.plan.memory import Budget

KV_FULL = 0.9
STARVED_SEQUENCES = 2  # fewer full-length sequences than this: one long request blocks all
MNBT_SHARE = 0.5  # max_num_batched_tokens above this share of the KV tokens
MNBT_CAP = 16384  # what to suggest at most: ~10K already keeps prefill efficient
HOT_FACTOR = 2.0
HOT_MIN = 4.0
HIT_MIN_DECISIONS = 20
STALE_AFTER_S = 10.0
CONTINUATION_REASONS = frozenset({"sticky", "prefix"})
VLLM_DEFAULT_MAX_NUM_SEQS = 256


@dataclass(frozen=True, slots=True)
class Finding:
    code: str
    severity: str  # severe | warning
    replica: str
    title: str
    evidence: tuple[str, ...]
    suggestion: str

    @property
    def severe(self) -> bool:
        return self.severity == "severe"

    def as_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "severity": self.severity,
            "replica": self.replica,
            "title": self.title,
            "evidence": list(self.evidence),
            "suggestion": self.suggestion,
        }


@dataclass(frozen=True, slots=True)
class Hints:
    """Engine arguments /metrics does not show (vLLM exposes no scheduler config)."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    expected_hit_rate: float | None = None
    # The engines run priority scheduling (vLLM does not report it; SGLang's server_info does).
    priority_scheduling: bool = False
    stale_after_s: float = STALE_AFTER_S
    # kvgate's kv_events.block_size, to compare with the engines' (None: not checked).
    kv_block_size: int | None = None
    # The replica's planned budget (--model/--card): activation arithmetic in GiB.
    budget: Budget | None = None
