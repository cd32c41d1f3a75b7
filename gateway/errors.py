"""One error tree for everything the gateway itself answers, and one renderer.

Each class knows its HTTP status, its OpenAI error `type` and `code`, and whether a retry
on another replica may help. Transport exceptions are mapped to this tree in exactly one
place (the upstream seam); every boundary that owns a response renders it with
`error_response_parts`.
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal

import orjson

# The dialect of the gateway's own error bodies on a route, and of the event in which a
# stream's failure is told (the Responses API numbers its events; Anthropic names them).
ErrorDialect = Literal["openai", "anthropic"]
EventDialect = Literal["openai", "responses", "anthropic"]


class GatewayError(Exception):
    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    code: ClassVar[str | None] = None
    retryable: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.error_type,
                    "param": self.param,
                    "code": self.code,
                }
            }
        )


class ConfigError(GatewayError):
    """Invalid configuration; raised at start-up, never on the request path."""

    code = "invalid_config"


class BadRequest(GatewayError):
    status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class InvalidJSON(BadRequest):
    code = "invalid_json"


class UnsupportedMediaType(GatewayError):
    status = 415
    error_type = "invalid_request_error"
    code = "unsupported_media_type"


class PayloadTooLarge(GatewayError):
    status = 413
    error_type = "invalid_request_error"
    code = "payload_too_large"


class Unauthorized(GatewayError):
    status = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    """A valid key asked for something it is not granted (class, model, pool, admin)."""

    status = 403
    error_type = "permission_error"
    code = "permission_denied"


class NotFound(GatewayError):
    status = 404
    error_type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    error_type = "invalid_request_error"
    code = "method_not_allowed"


class ModelNotFound(GatewayError):
    status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class RateLimited(GatewayError):
    """429 the SDKs will retry after `Retry-After`."""

    status = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, param: str | None = None):
        seconds = max(1, int(retry_after_s + 0.999))
        super().__init__(
            message,
            param=param,
            headers={"retry-after": str(seconds), "retry-after-ms": str(int(retry_after_s * 1000))},
        )


class NoHealthyReplica(GatewayError):
    status = 503
    error_type = "service_unavailable_error"
    code = "no_healthy_replica"

    def __init__(self, message: str, *, retry_after_s: int = 1, param: str | None = None):
        super().__init__(message, param=param, headers={"retry-after": str(retry_after_s)})


class UpstreamError(GatewayError):
    """The chosen replica failed before the response started."""

    status = 502
    error_type = "server_error"
    code = "upstream_error"


class UpstreamConnectError(UpstreamError):
    retryable = True
    code = "upstream_connect_error"


class UpstreamStatusError(UpstreamError):
    """The replica answered 502/503/504: retryable elsewhere, as long as nothing was sent."""

    retryable = True
    code = "upstream_unavailable"

    def __init__(self, message: str, *, upstream_status: int) -> None:
        super().__init__(message)
        self.upstream_status = upstream_status


class UpstreamTimeout(UpstreamError):
    """This request's own deadline passed. Not retried: an over-long request would time out
    on every replica in turn, and it says nothing about the replica's health."""

    status = 504
    code = "upstream_timeout"


class UpstreamStalled(UpstreamTimeout):
    """The request timed out and a canary showed the replica itself has stopped answering:
    the request is innocent, so it may go to another replica (nothing was sent yet). To the
    client it is still a timeout, if no other replica answers."""

    retryable = True


class UpstreamResponseTooLarge(UpstreamError):
    """A non-streaming answer larger than `limits.max_response_bytes`: not retried (the same
    request would get the same answer elsewhere) and not the replica's fault."""

    code = "upstream_response_too_large"


# Anthropic's error `type` for each status its API documents (others: "api_error").
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_body(err: GatewayError) -> bytes:
    """`err` in the Anthropic Messages API's error shape."""
    kind = _ANTHROPIC_TYPES.get(err.status, "api_error")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": err.message}})


_SEQUENCE = re.compile(rb'"sequence_number":\s*(\d+)')


def stream_error_event(
    err: GatewayError, shape: EventDialect = "openai", last: bytes = b""
) -> bytes:
    """A failure told in-band, once a stream has started, in the stream's own dialect.

    "openai" (chat, completions): a `data:` chunk holding OpenAI's error object, as vLLM
    sends it; "responses": the Responses API's `error` event, numbered after the last event
    relayed (read from `last`, the stream's last chunk); "anthropic": Messages' `error` event.
    """
    if shape == "anthropic":
        return b"event: error\ndata: " + anthropic_body(err) + b"\n\n"
    if shape == "responses":
        numbers = _SEQUENCE.findall(last)
        event = {
            "type": "error",
            "code": err.code or err.error_type,
            "message": err.message,
            "param": err.param,
            "sequence_number": int(numbers[-1]) + 1 if numbers else 0,
        }
        return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"
    return b"data: " + err.body() + b"\n\n"


def error_response_parts(
    err: GatewayError, shape: ErrorDialect = "openai"
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Status, raw ASGI headers and body for a gateway-made error, in the route's shape."""
    body = anthropic_body(err) if shape == "anthropic" else err.body()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    headers.extend(
        (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in err.headers.items()
    )
    return err.status, headers, body
