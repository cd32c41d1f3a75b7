"""Pure header filtering for a proxy hop (RFC 9110 section 7.6.1)."""

from __future__ import annotations

from collections.abc import Iterable

HOP_BY_HOP: frozenset[bytes] = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Client credentials the gateway knows (the SDKs' and Azure's): never for an engine, which
# gets the gateway's own key instead (Authorization only while the operator asks to pass it).
CREDENTIAL_HEADERS: frozenset[bytes] = frozenset({b"authorization", b"x-api-key", b"api-key"})
# Recomputed by the next hop; forwarding them would lie about the new message.
_REQUEST_DROP = HOP_BY_HOP | {b"host", b"content-length", b"expect"}
# When the gateway propagates trace context it sends its own traceparent (gateway.tracing).
_REQUEST_DROP_TRACED = _REQUEST_DROP | {b"traceparent"}
# X-Request-Id too: the gateway answers with its own (the client's, or one it minted).
_RESPONSE_DROP = HOP_BY_HOP | {b"content-length", b"x-request-id"}


def _filter(
    headers: Iterable[tuple[bytes, bytes]], drop: frozenset[bytes]
) -> list[tuple[bytes, bytes]]:
    out: list[tuple[bytes, bytes]] = []
    listed: set[bytes] | None = None
    for name, value in headers:
        lower = name.lower()
        if lower in drop:
            if lower == b"connection":
                listed = listed or set()
                listed.update(t.strip().lower() for t in value.split(b",") if t.strip())
            continue
        out.append((lower, value))
    if listed:
        # Headers named in Connection are hop-by-hop too (RFC 9110 section 7.6.1).
        out = [item for item in out if item[0] not in listed]
    return out


def request_headers(
    headers: Iterable[tuple[bytes, bytes]], *, traced: bool = False
) -> list[tuple[bytes, bytes]]:
    """Client request headers that may go to the engine (lower-cased names); `traced`
    leaves out the client's traceparent, which the caller replaces with its own."""
    return _filter(headers, _REQUEST_DROP_TRACED if traced else _REQUEST_DROP)


def response_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Engine response headers that may go to the client (lower-cased names).

    Content-Length is dropped too: the ASGI server recomputes framing for what we send;
    and X-Request-Id, which the proxy sets itself.
    """
    return _filter(headers, _RESPONSE_DROP)
