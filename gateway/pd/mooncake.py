"""vLLM's MooncakeConnector hand-off: the router mints the transfer id.

Unlike NIXL, the prefill engine answers with no `kv_transfer_params`: the router names the
transfer itself. The prefill leg gets `{do_remote_decode: true, transfer_id}` (vLLM 0.33
rejects a prefill without one: "Missing transfer_id in kv_transfer_params from router!");
the decode leg gets the same `transfer_id`, the prefill engine's `remote_engine_id` and
`remote_bootstrap_addr` (`http://<prefill host>:<bootstrap port>`, the engine's
`VLLM_MOONCAKE_BOOTSTRAP_PORT`, 8998 by default), and pulls the blocks from there.
The legs run one after the other, as for NIXL, under the same X-Request-Id.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from gateway.errors import GatewayError
from gateway.forward import Leg
from gateway.pd.config import ModelPDSettings
from gateway.pd.legs import LegBody, OpenLeg, commit_first_chunk
from gateway.pd.vllm import PREFILL_DROPPED
from gateway.types import ReplicaId


def new_transfer_id() -> str:
    return "kvgate-" + uuid.uuid4().hex


def prefill_body(body: Mapping[str, Any], transfer_id: str) -> dict[str, Any]:
    leg = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
    leg["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": transfer_id,
    }
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    return leg


def decode_body(
    body: Mapping[str, Any], transfer_id: str, bootstrap_addr: str, engine_id: str
) -> dict[str, Any]:
    leg = dict(body)
    leg["kv_transfer_params"] = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_bootstrap_addr": bootstrap_addr,
        "remote_engine_id": engine_id,
    }
    return leg


def bootstrap_addr(host: str, port: int) -> str:
    # The decoder appends its query path to it: the scheme is part of the address.
    return f"http://{host}:{port}"


async def handoff(
    open_leg: OpenLeg,
    leg_body: LegBody,
    prefill_replica: ReplicaId,
    addr: str,
    engine_id: str,
    decode_replicas: Sequence[ReplicaId],
    cfg: ModelPDSettings,
    first_byte_timeout_s: float | None,
) -> tuple[Leg | None, str]:
    """Prefill under a minted transfer id, then decode with failover; (leg or None, outcome)."""
    transfer_id = new_transfer_id()
    body = prefill_body(leg_body(prefill_replica, True), transfer_id)
    try:
        async with asyncio.timeout(cfg.prefill_timeout_s):
            leg = await open_leg(prefill_replica, orjson.dumps(body), None)
            try:
                await leg.response.read()
            finally:
                await leg.aclose()
    except (GatewayError, TimeoutError):
        return None, "prefill_failed"
    if leg.response.status != 200:
        return None, "prefill_failed"
    for attempt, replica in enumerate(decode_replicas[: cfg.decode_attempts]):
        payload = orjson.dumps(decode_body(leg_body(replica, False), transfer_id, addr, engine_id))
        try:
            decode = await open_leg(replica, payload, None)
            if decode.response.status >= 500:
                await decode.aclose()
                continue
            committed = await commit_first_chunk(decode, first_byte_timeout_s)
        except GatewayError:
            continue
        return committed, "served" if attempt == 0 else "served_after_decode_retry"
    return None, "decode_failed"
