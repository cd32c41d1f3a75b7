from __future__ import annotations

from gateway.upstream.headers import request_headers, response_headers


def test_request_headers_drop_hop_by_hop_and_framing() -> None:
    raw = [
        (b"Host", b"gw"),
        (b"Connection", b"keep-alive, X-Private"),
        (b"X-Private", b"1"),
        (b"Keep-Alive", b"timeout=5"),
        (b"Transfer-Encoding", b"chunked"),
        (b"TE", b"trailers"),
        (b"Content-Length", b"12"),
        (b"Authorization", b"Bearer k"),
        (b"X-Request-Id", b"abc"),
        (b"Proxy-Authorization", b"x"),
        (b"Upgrade", b"h2c"),
        (b"x-stainless-retry-count", b"0"),
    ]
    assert request_headers(raw) == [
        (b"authorization", b"Bearer k"),
        (b"x-request-id", b"abc"),
        (b"x-stainless-retry-count", b"0"),
    ]


def test_response_headers_keep_end_to_end() -> None:
    raw = [
        (b"content-type", b"text/event-stream"),
        (b"content-length", b"5"),
        (b"connection", b"close"),
        (b"x-ratelimit-remaining-requests", b"9"),
        (b"Trailer", b"x"),
        (b"content-encoding", b"gzip"),
    ]
    assert response_headers(raw) == [
        (b"content-type", b"text/event-stream"),
        (b"x-ratelimit-remaining-requests", b"9"),
        (b"content-encoding", b"gzip"),
    ]


def test_empty() -> None:
    assert request_headers([]) == [] and response_headers(()) == []
