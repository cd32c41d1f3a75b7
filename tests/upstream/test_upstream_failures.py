"""All three clients behind the seam against a raw engine stand-in on loopback that
misbehaves on purpose: bodies past the size limit (declared or not), connections closed
without an answer, answers that are not HTTP; and the one translation of transport errors,
whose messages never name the engine's address."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import httpx
import pytest

from gateway.errors import (
    GatewayError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamResponseTooLarge,
    UpstreamTimeout,
)
from gateway.upstream import Timeouts, UpstreamClient, make_client
from gateway.upstream.errors import map_transport_error, reason

KINDS = ["h1", "aiohttp", "httpx"]
LIMIT = 1000
Reply = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _head(reader: asyncio.StreamReader) -> None:
    await reader.readuntil(b"\r\n\r\n")


@pytest.fixture(params=KINDS)
async def client(request: pytest.FixtureRequest) -> AsyncIterator[UpstreamClient]:
    c = make_client(request.param, Timeouts(connect_s=1, response_headers_s=2, read_s=2), 8, LIMIT)
    yield c
    await c.aclose()


async def serve(reply: Reply) -> tuple[asyncio.Server, str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reply(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/v1/x"


async def _get(client: UpstreamClient, reply: Reply) -> bytes:
    server, url = await serve(reply)
    try:
        resp = await client.send("GET", url, [], b"")
        try:
            return await resp.read()
        finally:
            await resp.aclose()
    finally:
        server.close()
        await server.wait_closed()


async def test_a_declared_length_past_the_limit_is_refused_before_reading(
    client: UpstreamClient,
) -> None:
    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000)
        await writer.drain()

    with pytest.raises(UpstreamResponseTooLarge, match=f"exceeds the {LIMIT}-byte limit"):
        await _get(client, big)


async def test_an_undeclared_body_past_the_limit_is_cut_off(client: UpstreamClient) -> None:
    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(8):
            writer.write(b"100\r\n" + b"y" * 256 + b"\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    with pytest.raises(UpstreamResponseTooLarge):
        await _get(client, chunked)


async def test_a_body_at_the_limit_is_read_whole(client: UpstreamClient) -> None:
    async def exact(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"z" * LIMIT)
        await writer.drain()

    assert await _get(client, exact) == b"z" * LIMIT


async def test_a_connection_closed_without_an_answer_is_a_retryable_connect_error(
    client: UpstreamClient,
) -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)

    with pytest.raises(UpstreamConnectError) as caught:
        await _get(client, hang_up)
    assert caught.value.retryable and "127.0.0.1" not in caught.value.message


async def test_an_answer_that_is_not_http_is_an_upstream_error(client: UpstreamClient) -> None:
    async def babble(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()

    with pytest.raises(UpstreamError) as caught:
        await _get(client, babble)
    assert "127.0.0.1" not in caught.value.message


@pytest.mark.parametrize(
    ("exc", "kind", "said"),
    [
        (httpx.ConnectTimeout("to 10.0.0.5"), UpstreamConnectError, "connecting timed out"),
        (httpx.ReadTimeout("from 10.0.0.5"), UpstreamTimeout, "the engine timed out"),
        (TimeoutError(), UpstreamTimeout, "the engine timed out"),
        (
            ConnectionRefusedError(errno.ECONNREFUSED, "Connect call failed ('10.0.0.5', 80)"),
            UpstreamConnectError,
            "dropped the connection (Connection refused)",
        ),
        (aiohttp.ServerDisconnectedError(), UpstreamConnectError, "(ServerDisconnectedError)"),
        (asyncio.IncompleteReadError(b"", 10), UpstreamError, "(IncompleteReadError)"),
        (httpx.UnsupportedProtocol("ftp://10.0.0.5"), UpstreamError, "(UnsupportedProtocol)"),
        (ValueError("10.0.0.5"), UpstreamError, "failed unexpectedly (ValueError)"),
    ],
)
def test_transport_errors_map_to_one_tree_and_never_name_the_address(
    exc: BaseException, kind: type[GatewayError], said: str
) -> None:
    mapped = map_transport_error(exc, "http://10.0.0.5:80")
    assert type(mapped) is kind and said in mapped.message
    assert "10.0.0.5" not in mapped.message


def test_errors_already_translated_pass_through_and_wrapped_os_errors_are_read() -> None:
    done = UpstreamTimeout("already said")
    assert map_transport_error(done) is done

    class Wrapped(Exception):
        os_error = OSError(errno.EHOSTUNREACH, "No route to 10.0.0.5")

    assert reason(Wrapped()) == "No route to host"
    assert reason(OSError("no errno")) == "OSError"
