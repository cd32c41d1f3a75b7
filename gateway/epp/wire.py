"""Envoy's ext_proc messages in and out: headers, `envoy.lb` metadata, the responses.

The generated classes come from `xds-protos` (built by the gRPC project from Envoy's
data-plane API). Everything here is a pure function of its arguments.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    ImmediateResponse,
    ProcessingRequest,
    ProcessingResponse,
    StreamedBodyResponse,
    TrailersResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

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


def _option(name: str, value: bytes) -> HeaderValueOption:
    return HeaderValueOption(
        header=HeaderValue(key=name, raw_value=value),
        append_action=HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def mutation(
    set_headers: Iterable[tuple[str, bytes]], remove: Iterable[str] = ()
) -> HeaderMutation:
    return HeaderMutation(
        set_headers=[_option(n, v) for n, v in set_headers], remove_headers=list(remove)
    )


def destination_response(
    destinations: str, set_headers: list[tuple[str, bytes]], remove: list[str]
) -> ProcessingResponse:
    """The one request-headers answer: route cache cleared, the destination header and the
    same value under `envoy.lb` in the dynamic metadata."""
    metadata = Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: destinations}})
    return ProcessingResponse(
        request_headers=HeadersResponse(
            response=CommonResponse(
                header_mutation=mutation(set_headers, remove), clear_route_cache=True
            )
        ),
        dynamic_metadata=metadata,
    )


def request_body_chunks(
    body: bytes, chunk_bytes: int, *, end: bool = True
) -> Iterator[ProcessingResponse]:
    """`body` re-streamed as request-body answers of at most `chunk_bytes`; the last one
    carries the end of stream (when `end`)."""
    if not body:
        yield ProcessingResponse(request_body=_streamed(b"", end))
        return
    for start in range(0, len(body), chunk_bytes):
        last = start + chunk_bytes >= len(body)
        yield ProcessingResponse(
            request_body=_streamed(body[start : start + chunk_bytes], end and last)
        )


def response_body(chunk: bytes, end: bool) -> ProcessingResponse:
    return ProcessingResponse(response_body=_streamed(chunk, end))


def _streamed(chunk: bytes, end: bool) -> BodyResponse:
    return BodyResponse(
        response=CommonResponse(
            body_mutation=BodyMutation(
                streamed_response=StreamedBodyResponse(body=chunk, end_of_stream=end)
            )
        )
    )


def response_headers(set_headers: list[tuple[str, bytes]]) -> ProcessingResponse:
    return ProcessingResponse(
        response_headers=HeadersResponse(
            response=CommonResponse(header_mutation=mutation(set_headers))
        )
    )


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
