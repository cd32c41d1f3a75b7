"""`EngineFacts`: the few things an engine's own description says that kvgate acts on.

vLLM 0.33 has no `/server_info` (outside its dev mode) but serves `GET /kv_event_sources`
(its KV event publisher per DP rank, `{}` without `--kv-events-config`) and `/v1/models`;
SGLang 0.5.23 describes itself under `/server_info`: its server args (`page_size`,
`enable_metrics`, `schedule_low_priority_values_first`, `enable_cache_report`), what the
scheduler resolved (`max_total_num_tokens`) and its publisher (`kv_events`).

Pure: parsing only. What the engine leaves out stays None, and every reader then keeps
its safe default (no `priority` sent while the direction is unknown, the scraped
capacity, the configured block size).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["vllm", "sglang"]


@dataclass(frozen=True, slots=True)
class EngineFacts:
    kind: Kind
    # Larger `priority` values run first (SGLang's default); None: the engine did not say.
    runs_higher_first: bool | None = None
    page_size: int | None = None
    metrics_enabled: bool | None = None
    cache_report: bool | None = None
    capacity_tokens: int | None = None
    models: tuple[str, ...] = ()
    # The publisher description as the engine gives it: vLLM's `/kv_event_sources` body,
    # SGLang's `/server_info` `kv_events` (gateway.kvevents.discover reads them).
    kv_events: Mapping[str, Any] | None = None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def from_server_info(info: Any) -> EngineFacts | None:
    """SGLang's `/server_info` answer (None if it is not a JSON object)."""
    if not isinstance(info, Mapping):
        return None
    low_first = _bool(info.get("schedule_low_priority_values_first"))
    kv = info.get("kv_events")
    model = info.get("served_model_name") or info.get("model_path")
    return EngineFacts(
        "sglang",
        runs_higher_first=None if low_first is None else not low_first,
        page_size=_int(info.get("page_size")),
        metrics_enabled=_bool(info.get("enable_metrics")),
        cache_report=_bool(info.get("enable_cache_report")),
        capacity_tokens=_int(info.get("max_total_num_tokens")),
        models=(model,) if isinstance(model, str) else (),
        kv_events=kv if isinstance(kv, Mapping) else None,
    )


def from_vllm(sources: Any, models: Any) -> EngineFacts:
    """vLLM's `/kv_event_sources` and `/v1/models` answers (either may be None). vLLM runs
    lower `priority` values first, always; its block size and capacity come from its
    `cache_config_info` metric (gateway.scrape)."""
    cards = models.get("data") if isinstance(models, Mapping) else None
    names = tuple(
        c["id"] for c in cards or () if isinstance(c, Mapping) and isinstance(c.get("id"), str)
    )
    return EngineFacts(
        "vllm",
        runs_higher_first=False,
        models=names,
        kv_events=sources if isinstance(sources, Mapping) else None,
    )
