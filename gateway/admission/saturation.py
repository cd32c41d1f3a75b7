"""Pure saturation test for one replica.

Scrapes are periodic, so between two scrapes the gateway corrects the scraped waiting queue
with what it has sent or seen finish since: `waiting + (inflight_now - inflight_at_scrape)`.
Without that correction every request arriving between two scrapes would pass the check
and pile onto the engine's queue.

Unknown or stale load (no scrape yet, scraper failing, scrape older than the view's
`stale_after`): the replica counts as saturated only while the gateway has work in flight to
it. An idle replica always admits one request, so a replica whose metrics are missing is
served one request at a time instead of being starved or flooded. Set `max_inflight` to
judge such replicas by the in-flight count alone.

No engine load at all (the engine serves no `/metrics`, e.g. SGLang without
`--enable-metrics`): the scraper publishes an empty load marked `engine=False` at each scrape
(issue 44), so the replica is not unknown; only the gateway's own counts (`max_inflight`,
`max_prompt_tokens`, `max_prefill_tokens`) hold requests back, and requests run concurrently.

`max_prompt_tokens` counts the prompt tokens of the gateway's own requests in flight. An
engine that schedules running requests first lets a few long prefills take its whole
step budget; bounding them keeps room for short and high-class requests. One request
larger than the bound still goes alone, when nothing else of its weight is in flight.

`max_prefill_tokens` counts only requests still prefilling (no first byte yet), each
weighed by what it can take of one engine step. It frees as soon as a prefill ends, so it
can be set near the step budget; with class holdbacks the lower classes never fill a whole
step, and a better class's prefill is not scheduled behind a wall of theirs.
"""

from __future__ import annotations

from gateway.admission.config import SaturationThresholds
from gateway.types import EngineLoad


def is_saturated(
    load: EngineLoad | None,
    inflight: int,
    inflight_at_scrape: int,
    thresholds: SaturationThresholds,
    prompt_tokens_inflight: int = 0,
    prompt_tokens: int = 0,
    prefill_tokens_inflight: int = 0,
    prefill_tokens: int = 0,
) -> bool:
    """True when one more request (of `prompt_tokens`) sent now would have to queue.

    `load` must already be None when stale (see `ClusterView.load_of`); `inflight` is the
    gateway's live count for the replica; `inflight_at_scrape` the count when this `load`
    was first seen; `prompt_tokens_inflight` the prompt tokens of requests in flight;
    `prefill_tokens_inflight` the step weight of those still prefilling.
    """
    max_inflight = thresholds.max_inflight
    if max_inflight is not None and inflight >= max_inflight:
        return True
    max_tokens = thresholds.max_prompt_tokens
    if (
        max_tokens is not None
        and prompt_tokens_inflight > 0
        and prompt_tokens_inflight + prompt_tokens > max_tokens
    ):
        return True
    max_prefill = thresholds.max_prefill_tokens
    if (
        max_prefill is not None
        and prefill_tokens_inflight > 0
        and prefill_tokens_inflight + prefill_tokens > max_prefill
    ):
        return True
    if load is None:
        return max_inflight is None and inflight > 0
    sent_since = inflight - inflight_at_scrape
    max_waiting = thresholds.max_waiting
    if max_waiting is not None and load.waiting + sent_since >= max_waiting:
        return True
    max_kv = thresholds.max_kv_usage
    # KV usage cannot be corrected between scrapes; a request that finished since the scrape
    # freed blocks, so only a replica with nothing finished since counts as still full.
    return (
        max_kv is not None
        and load.kv_usage is not None
        and load.kv_usage >= max_kv
        and sent_since >= 0
    )
