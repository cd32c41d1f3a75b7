"""Envoy's ext_proc messages in and out: headers, `envoy.lb` metadata, the responses.

The generated classes come from `xds-protos` (built by the gRPC project from Envoy's
data-plane API). Everything here is a pure function of its arguments.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValueOption
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HeaderMutation,
    ImmediateResponse,
    ProcessingRequest,
    ProcessingResponse,
    TrailersResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus

# The EPP protocol's names (GIE docs/proposals/004-endpoint-picker-protocol).
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
DESTINATION = "x-gateway-destination-endpoint"
SUBSET = "x-gateway-destination-endpoint-subset"
SERVED = "x-gateway-destination-endpoint-served"
# Why a request was refused, in llm-d's header and values (a convention, not GIE's).
DROPPED_REASON = "x-llm-d-request-dropped-reason"

RawHeaders = list[tuple[bytes, bytes]]


def headers_of(header_map: HeaderMap) -> RawHeaders:
    """Envoy's header map as lower-cased (name, value) bytes; pseudo-headers included."""
    out: RawHeaders = []
    for h in header_map.headers:
        value = h.raw_value if h.raw_value else h.value.encode("latin-1")
        out.append((h.key.lower().encode("latin-1"), value))
    return out


def metadata_value(request: ProcessingRequest, namespace: str, key: str) -> object:
    """`metadata_context.filter_metadata[namespace][key]` as plain Python, or None."""
    filters = request.metadata_context.filter_metadata
    if namespace not in filters:
        return None
    fields = filters[namespace].fields
    if key not in fields:
        return None
    value = fields[key]
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.HasField("string_value")]
    return None


def address_list(value: object) -> list[str] | None:
    """A hint's `ip:port` entries: a list, or one comma-separated string (as the LWEPP)."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list):
        return None
    return [s.strip() for s in items if isinstance(s, str) and s.strip()]


# The builders below set fields in place on one new message rather than nesting
# constructors: each nested constructor builds a message and copies it into its parent
# (about three times the work for a streamed chunk, measured with timeit).


def _set(target: HeaderMutation, set_headers: Iterable[tuple[str, bytes]]) -> None:
    for name, value in set_headers:
        option = target.set_headers.add()
        option.header.key = name
        option.header.raw_value = value
        option.append_action = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def mutation(
    set_headers: Iterable[tuple[str, bytes]], remove: Iterable[str] = ()
) -> HeaderMutation:
    out = HeaderMutation()
    _set(out, set_headers)
    out.remove_headers.extend(remove)
    return out


def destination_response(
    destinations: str, set_headers: list[tuple[str, bytes]], remove: list[str]
) -> ProcessingResponse:
    """The one request-headers answer: route cache cleared, the destination header and the
    same value under `envoy.lb` in the dynamic metadata."""
    out = ProcessingResponse()
    common = out.request_headers.response
    common.clear_route_cache = True
    _set(common.header_mutation, set_headers)
    common.header_mutation.remove_headers.extend(remove)
    lb = out.dynamic_metadata.fields[LB_NAMESPACE].struct_value
    lb.fields[DESTINATION].string_value = destinations
    return out


def request_body_chunks(
    body: bytes, chunk_bytes: int, *, end: bool = True
) -> Iterator[ProcessingResponse]:
    """`body` re-streamed as request-body answers of at most `chunk_bytes`; the last one
    carries the end of stream (when `end`)."""
    if not body:
        yield _streamed(b"", end, request=True)
        return
    for start in range(0, len(body), chunk_bytes):
        last = start + chunk_bytes >= len(body)
        yield _streamed(body[start : start + chunk_bytes], end and last, request=True)


def response_body(chunk: bytes, end: bool) -> ProcessingResponse:
    if not chunk:
        # Envoy ends most bodies with an empty chunk: the same answer every time.
        return _EMPTY_END if end else _EMPTY
    return _streamed(chunk, end, request=False)


def _streamed(chunk: bytes, end: bool, *, request: bool) -> ProcessingResponse:
    out = ProcessingResponse()
    body = out.request_body if request else out.response_body
    streamed = body.response.body_mutation.streamed_response
    streamed.body = chunk
    streamed.end_of_stream = end
    return out


_EMPTY = _streamed(b"", False, request=False)
_EMPTY_END = _streamed(b"", True, request=False)


def response_headers(set_headers: list[tuple[str, bytes]]) -> ProcessingResponse:
    out = ProcessingResponse()
    # With no header to set, nothing below is assigned and the oneof would stay empty:
    # Envoy counts such an answer spurious and fails the request with a 500.
    out.response_headers.SetInParent()
    _set(out.response_headers.response.header_mutation, set_headers)
    return out


EMPTY_REQUEST_TRAILERS = ProcessingResponse(request_trailers=TrailersResponse())
EMPTY_RESPONSE_TRAILERS = ProcessingResponse(response_trailers=TrailersResponse())


def immediate(
    status: int, headers: RawHeaders, body: bytes, reason: str | None = None
) -> ProcessingResponse:
    """Envoy answers the client itself: `status`, `headers`, `body` (the gateway's error)."""
    out = [(n.decode("latin-1"), v) for n, v in headers if n != b"content-length"]
    if reason is not None:
        out.append((DROPPED_REASON, reason.encode()))
    return ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=status),
            headers=mutation(out),
            body=body,
            details=reason or "",
        )
    )
