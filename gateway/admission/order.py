"""Pure ranking of waiting requests: class, then shortest predicted work, with aging.

Every waiter gets a fixed score in seconds, `enqueued_at + class penalty + size penalty`,
and the lowest score goes first. Because waiting lifts every waiter at the same rate, aging
needs no re-sorting: a score is computed once and kept in a heap. Penalties are bounded, so a
request is never overtaken by one that arrived more than `aging_bound_s` after it; this is
what rules out starvation of long and low-class requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.admission.config import AdmissionSettings
from gateway.types import RouteRequest


@dataclass(frozen=True, slots=True)
class Ordering:
    """The numbers ranking needs, taken once from `AdmissionSettings`."""

    class_index: dict[str, int]
    class_head_start_s: float
    size_head_start_s: float
    work_cap_tokens: int
    expected_output_cap: int
    default_expected_output: int
    output_token_weight: float

    @classmethod
    def from_settings(cls, settings: AdmissionSettings) -> Ordering:
        return cls(
            class_index={c.name: i for i, c in enumerate(settings.classes)},
            class_head_start_s=settings.class_head_start_s,
            size_head_start_s=settings.size_head_start_s,
            work_cap_tokens=settings.work_cap_tokens,
            expected_output_cap=settings.expected_output_cap,
            default_expected_output=settings.default_expected_output,
            output_token_weight=settings.output_token_weight,
        )

    @property
    def aging_bound_s(self) -> float:
        return self.class_head_start_s * (len(self.class_index) - 1) + self.size_head_start_s


def expected_output(
    max_tokens: int | None, tenant_average: float | None, cap: int, default: int
) -> float:
    """Expected output tokens: `max_tokens` is an upper bound, the tenant's history a guess.

    The smaller of the two is used, capped, so a client asking for a huge `max_tokens` out of
    habit is judged by what it actually produced recently.
    """
    bound = float(min(max_tokens, cap)) if max_tokens is not None and max_tokens > 0 else None
    if tenant_average is not None:
        guess = min(tenant_average, float(cap))
        return guess if bound is None else min(bound, guess)
    return bound if bound is not None else float(min(default, cap))


def predicted_work(
    prompt_tokens: int, cached_tokens: int, expected_output_tokens: float, output_weight: float
) -> float:
    """Remaining work in prompt-token units: uncached prompt plus weighted expected output."""
    uncached = max(0, prompt_tokens - max(0, cached_tokens))
    return uncached + output_weight * max(0.0, expected_output_tokens)


def size_fraction(work: float, cap: int) -> float:
    """0 for no work, 1 at or above `cap`, logarithmic in between.

    Logarithmic so that each order of magnitude of size buys the same head start: a 100-token
    request clearly beats a 10 000-token one, even when the cap is far above both.
    """
    if work <= 0:
        return 0.0
    return min(1.0, math.log1p(work) / math.log1p(cap))


def score(enqueued_at: float, class_idx: int, work: float, ordering: Ordering) -> float:
    """Release rank (lower goes first); stays valid for the whole wait, see the module doc."""
    return (
        enqueued_at
        + class_idx * ordering.class_head_start_s
        + size_fraction(work, ordering.work_cap_tokens) * ordering.size_head_start_s
    )


def request_score(
    request: RouteRequest,
    enqueued_at: float,
    ordering: Ordering,
    *,
    cached_tokens: int = 0,
    tenant_average: float | None = None,
) -> float:
    """`score` for a `RouteRequest`; an unknown class ranks with the last class."""
    class_idx = ordering.class_index.get(request.priority_class, len(ordering.class_index) - 1)
    out = expected_output(
        request.max_tokens,
        tenant_average,
        ordering.expected_output_cap,
        ordering.default_expected_output,
    )
    work = predicted_work(request.prompt_tokens, cached_tokens, out, ordering.output_token_weight)
    return score(enqueued_at, class_idx, work, ordering)
