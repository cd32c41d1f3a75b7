"""Responses API continuations: `previous_response_id` names an answer that vLLM keeps in
the memory of the one replica that produced it, so the next turn must go there.

The answer's id is read as it passes (gateway.proxy.relay) and recorded in the session
placements (gateway.store: local, or shared through Redis) under a key made from the id;
a request continuing it takes that key as its session key, so the identity stage finds the
replica, and the attempts stage pins the request to it.
"""

from __future__ import annotations

import re

import orjson

from gateway.auth.principal import Principal
from gateway.hashing import digest_hex
from gateway.proxy.identity import with_key
from gateway.state import GatewayState
from gateway.types import RouteRequest, SessionKey

KEY_SOURCE = "previous_response_id"

# vLLM's ids are "resp_" + hex; the first event of a stream (`response.created`) has it.
_ID = re.compile(rb'"id"\s*:\s*"(resp[_-][A-Za-z0-9_-]{1,200})"')


def response_key(response_id: str) -> SessionKey:
    return SessionKey("r:" + digest_hex(response_id))


def tenant_key(response_id: str) -> SessionKey:
    """Where the tenant that made a stored response is kept (keys on): only its keys may
    read, cancel, delete or continue it (gateway.proxy.stored)."""
    return SessionKey("t:" + digest_hex(response_id))


async def may_use(state: GatewayState, principal: Principal | None, response_id: str) -> bool:
    """Whether `principal` may touch the stored response `response_id`: keys off, an admin
    key, or a key of the tenant recorded when it was made. Unrecorded: no (it may be
    anyone's)."""
    if principal is None or principal.admin:
        return True
    placements = state.placements
    if placements is None:
        return False
    return await placements.lookup(tenant_key(response_id)) == principal.tenant


def continuing(request: RouteRequest, previous_id: str) -> RouteRequest:
    """`request` keyed on the answer it continues (keeps everything else)."""
    return with_key(request, response_key(previous_id), KEY_SOURCE)


def id_in_json(payload: bytes) -> str | None:
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    value = data.get("id") if isinstance(data, dict) else None
    return value if isinstance(value, str) else None


def id_in_stream(chunk: bytes) -> str | None:
    match = _ID.search(chunk)
    return match.group(1).decode("ascii") if match else None
