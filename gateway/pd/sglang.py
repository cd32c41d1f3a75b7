"""SGLang bootstrap-style hand-off: the same body goes to both legs at once.

Both engines meet in a "bootstrap room" on the prefill engine's bootstrap server; the
gateway only names the room. If one leg dies the other waits for a peer that never comes,
so the legs live and die together.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import orjson

from gateway.errors import GatewayError, UpstreamError
from gateway.forward import Leg
from gateway.pd.config import ModelPDSettings
from gateway.pd.legs import LegBody, OpenLeg, cancel_task, commit_first_chunk
from gateway.types import ReplicaId

MAX_ROOM = 2**63 - 1


def new_room(rng: random.Random) -> int:
    return rng.randint(0, MAX_ROOM)


def bootstrap_host(replica_url: str) -> str:
    return urlsplit(replica_url).hostname or "127.0.0.1"


def with_bootstrap(body: Mapping[str, Any], host: str, port: int, room: int) -> dict[str, Any]:
    leg = dict(body)
    leg["bootstrap_host"] = host
    leg["bootstrap_port"] = port
    leg["bootstrap_room"] = room
    return leg


async def _prefill(open_leg: OpenLeg, replica: ReplicaId, payload: bytes, timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        leg = await open_leg(replica, payload, None)
        try:
            if leg.response.status != 200:
                raise UpstreamError(f"prefill replica {replica} answered {leg.response.status}")
            # Drained, not just closed: the prefill engine answers once its KV went out.
            await leg.response.read()
        finally:
            await leg.aclose()


def _failed(task: asyncio.Task[None]) -> bool:
    return task.done() and (task.cancelled() or task.exception() is not None)


async def _discard(opening: asyncio.Future[Leg]) -> None:
    if not opening.done():
        opening.cancel()
    try:
        leg = await opening
    except (asyncio.CancelledError, GatewayError, TimeoutError):
        return
    await leg.aclose()


async def _open_decode(
    open_leg: OpenLeg, replica: ReplicaId, payload: bytes, prefill: asyncio.Task[None]
) -> Leg:
    """Open the decode leg, giving up as soon as the prefill leg fails."""
    opening: asyncio.Future[Leg] = asyncio.ensure_future(open_leg(replica, payload, None))
    try:
        await asyncio.wait((opening, prefill), return_when=asyncio.FIRST_COMPLETED)
        if not opening.done():
            if _failed(prefill):
                raise UpstreamError("prefill leg failed before the decode leg answered")
            await opening
        leg = opening.result()
    except BaseException:
        await _discard(opening)
        raise
    if _failed(prefill):
        await leg.aclose()
        raise UpstreamError("prefill leg failed before the decode leg answered")
    return leg


async def handoff(
    open_leg: OpenLeg,
    leg_body: LegBody,
    prefill_replica: ReplicaId,
    prefill_host: str,
    bootstrap_port: int,
    decode_replica: ReplicaId,
    cfg: ModelPDSettings,
    first_byte_timeout_s: float | None,
    rng: random.Random,
) -> tuple[Leg | None, str]:
    """Both legs at once; (the committed decode leg or None, outcome).

    The decode leg cannot move to another replica (the prefill engine waits for this one
    in the room), so any failure before the first byte cancels both and falls back.
    """
    room = new_room(rng)
    prefill_body = leg_body(prefill_replica, True)
    decode_body = leg_body(decode_replica, False)
    payload = orjson.dumps(with_bootstrap(prefill_body, prefill_host, bootstrap_port, room))
    decode_payload = (
        payload
        if decode_body is prefill_body
        else orjson.dumps(with_bootstrap(decode_body, prefill_host, bootstrap_port, room))
    )
    prefill = asyncio.create_task(
        _prefill(open_leg, prefill_replica, payload, cfg.prefill_timeout_s)
    )
    try:
        leg = await _open_decode(open_leg, decode_replica, decode_payload, prefill)
        if leg.response.status >= 500:
            await leg.aclose()
            raise UpstreamError(f"decode replica {decode_replica} answered {leg.response.status}")
        # From here the committed leg owns the prefill task and cancels it when closed.
        return await commit_first_chunk(leg, first_byte_timeout_s, watch=prefill), "served"
    except GatewayError:
        failed_first = _failed(prefill)
        await cancel_task(prefill)
        return None, "prefill_failed" if failed_first else "decode_failed"
    except BaseException:
        await cancel_task(prefill)
        raise
