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
from gateway.proxy.identity import with_key
from gateway.types import RouteRequest, SessionKey

KEY_SOURCE = "previous_response_id"

# vLLM's ids are "resp_" + hex; the first event of a stream (`response.created`) has it.
_ID = re.compile(rb'"id"\s*:\s*"(resp[_-][A-Za-z0-9_-]{1,200})"')


def response_key(response_id: str) -> SessionKey:
    return SessionKey("r:" + digest_hex(response_id))


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
