"""Responses API continuations: `previous_response_id` names an answer that vLLM keeps in
the memory of the one replica that produced it, so the next turn must go there.

The answer's id is read as it passes (gateway.proxy.relay) and recorded in the session
placements (gateway.store: local, or shared through Redis) under a key made from the id,
with a link to the root of its chain (the answer that opened the conversation). A request
continuing an answer is keyed on its chain: the root's `chain_key`, the same on every
gateway and every turn, so a conversation is one session. The identity stage sends it to
the replica holding the answer it continues, or, with no record of that answer (aged out,
recorded on another gateway that went away), where its chain is placed; the attempts stage
pins it there.
"""

from __future__ import annotations

import re

import orjson

from gateway.hashing import digest_hex
from gateway.hooks import SessionPlacements
from gateway.proxy.identity import with_key
from gateway.scope import Caller
from gateway.state import GatewayState
from gateway.types import ReplicaId, RouteRequest, SessionKey

KEY_SOURCE = "previous_response_id"

# vLLM's ids are "resp_" + hex; the first event of a stream (`response.created`) has it.
_ID = re.compile(rb'"id"\s*:\s*"(resp[_-][A-Za-z0-9_-]{1,200})"')


def response_key(response_id: str) -> SessionKey:
    return SessionKey("r:" + digest_hex(response_id))


def tenant_key(response_id: str) -> SessionKey:
    """Where the tenant that made a stored response is kept (keys on): only its keys may
    read, cancel, delete or continue it (gateway.proxy.stored)."""
    return SessionKey("t:" + digest_hex(response_id))


async def may_use(state: GatewayState, principal: Caller | None, response_id: str) -> bool:
    """Whether `principal` may touch the stored response `response_id`: keys off, an admin
    key, or a key of the tenant recorded when it was made. Unrecorded: no (it may be
    anyone's)."""
    if principal is None or principal.admin:
        return True
    placements = state.placements
    if placements is None:
        return False
    return await placements.lookup(tenant_key(response_id)) == principal.tenant


def response_digest(response_id: str) -> str:
    return digest_hex(response_id)


def chain_key(root: str) -> SessionKey:
    """The session of the chain whose root answer has the digest `root`."""
    return SessionKey("rc:" + root)


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


async def remember(
    placements: SessionPlacements,
    response_id: str,
    replica: ReplicaId,
    principal: Caller | None,
    chain_root: str | None,
) -> None:
    """Record an answer the engine stored: where it is, whose it is, and its chain (linked
    to the chain's root, or, opening one, the chain placed where the answer is)."""
    await placements.record(response_key(response_id), replica)
    if principal is not None:
        await placements.record(tenant_key(response_id), ReplicaId(principal.tenant))
    if chain_root is not None:
        await placements.link_response(response_digest(response_id), chain_root)
    else:
        await placements.record(chain_key(response_digest(response_id)), replica)
