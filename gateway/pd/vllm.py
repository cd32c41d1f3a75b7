"""vLLM connector-style hand-off (NIXL and friends): prefill first, then decode.

The prefill leg runs the prompt with one output token and no streaming and answers with
`kv_transfer_params` describing where its KV blocks wait; the decode leg gets the original
body with those params, unchanged, under the same X-Request-Id (older connectors correlate
the two legs by that id).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from gateway.errors import GatewayError
from gateway.forward import Leg
from gateway.pd.config import ModelPDSettings
from gateway.pd.legs import LegBody, OpenLeg, commit_first_chunk
from gateway.types import ReplicaId

# Asks the prefill engine to keep the blocks for a remote decoder.
_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Prefill engines reject these when they only produce one token.
PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    leg = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
    leg["kv_transfer_params"] = dict(_PREFILL_PARAMS)
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    return leg


def kv_params_from(response: object) -> dict[str, Any] | None:
    """The prefill answer's `kv_transfer_params`, relayed verbatim (it is opaque to us)."""
    if not isinstance(response, dict):
        return None
    params = response.get("kv_transfer_params")
    return params if isinstance(params, dict) and params else None


def decode_body(body: Mapping[str, Any], kv_params: Mapping[str, Any]) -> dict[str, Any]:
    leg = dict(body)
    leg["kv_transfer_params"] = dict(kv_params)
    return leg


async def prefill(
    open_leg: OpenLeg, replica: ReplicaId, body: Mapping[str, Any], timeout_s: float
) -> dict[str, Any] | None:
    """Run the prefill leg to completion; its `kv_transfer_params`, or None if it failed."""
    try:
        async with asyncio.timeout(timeout_s):
            leg = await open_leg(replica, orjson.dumps(prefill_body(body)), None)
            try:
                raw = await leg.response.read()
            finally:
                await leg.aclose()
    except (GatewayError, TimeoutError):
        return None
    if leg.response.status != 200:
        return None
    try:
        return kv_params_from(orjson.loads(raw))
    except orjson.JSONDecodeError:
        return None


async def handoff(
    open_leg: OpenLeg,
    leg_body: LegBody,
    prefill_replica: ReplicaId,
    decode_replicas: Sequence[ReplicaId],
    cfg: ModelPDSettings,
    first_byte_timeout_s: float | None,
) -> tuple[Leg | None, str]:
    """Prefill, then decode with failover; (the committed decode leg or None, outcome)."""
    params = await prefill(
        open_leg, prefill_replica, leg_body(prefill_replica, True), cfg.prefill_timeout_s
    )
    if params is None:
        return None, "prefill_failed"
    # The prefill engine keeps the blocks until a decoder pulls them, so a decoder that
    # failed before answering can be replaced by another with the same params.
    for attempt, replica in enumerate(decode_replicas[: cfg.decode_attempts]):
        payload = orjson.dumps(decode_body(leg_body(replica, False), params))
        try:
            leg = await open_leg(replica, payload, None)
            if leg.response.status >= 500:
                await leg.aclose()
                continue
            committed = await commit_first_chunk(leg, first_byte_timeout_s)
        except GatewayError:
            continue
        return committed, "served" if attempt == 0 else "served_after_decode_retry"
    return None, "decode_failed"
