"""Request bodies forwarded as they arrive (multipart audio): never held whole.

`open_upload` reads the first few ASGI messages only, until the form's leading text fields
are in hand (the SDKs put `model`, `language`, `stream` ... before the file) or `HEAD_BYTES`
were read. The returned `Upload` is the body the upstream client sends: those first bytes,
then the rest of the client's body message by message, so the gateway holds one message
(uvicorn's read size) at a time, however large the file.

The body limit holds while streaming: a declared `Content-Length` over it is refused before
anything is read, a chunked body that grows past it fails the upload (`failure`), which
aborts the engine's connection and answers 413 when the engine has not answered yet.

A streamed body cannot be replayed: `sent` says whether any byte went to the upstream
client, after which the proxy retries nothing.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from gateway.body import ClientGone
from gateway.errors import PayloadTooLarge

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]

# How far into a form the gateway looks for its leading text fields: a field placed after
# the file (or past this) is not read, and the request is routed without it.
HEAD_BYTES = 64 * 1024
# Longer text fields are not kept (a prompt of many KB says nothing the router needs).
MAX_FIELD_BYTES = 512

_PARAM = re.compile(rb';\s*(name|filename)\s*=\s*(?:"([^"]*)"|([^\s;"]+))', re.IGNORECASE)


def _disposition(part_headers: bytes) -> tuple[bytes | None, bool]:
    """(name, is a file) from one part's header lines."""
    for line in part_headers.split(b"\r\n"):
        if line[:20].lower() == b"content-disposition:":
            name: bytes | None = None
            is_file = False
            for key, quoted, bare in _PARAM.findall(line):
                if key.lower() == b"name":
                    name = quoted or bare
                else:
                    is_file = True
            return name, is_file
    return None, False


def leading_fields(head: bytes, boundary: bytes) -> tuple[dict[str, str], bool]:
    """The text fields a multipart form opens with, and whether they are all in `head`.

    Complete once the first file part (or the closing delimiter) begins: no field after it
    is looked for. Incomplete while `head` ends inside a field or its part headers.
    """
    delimiter = b"--" + boundary
    fields: dict[str, str] = {}
    at = head.find(delimiter)
    while at >= 0:
        at += len(delimiter)
        if len(head) < at + 2:
            return fields, False
        if head[at : at + 2] == b"--":
            return fields, True
        headers_end = head.find(b"\r\n\r\n", at)
        if headers_end < 0:
            return fields, False
        name, is_file = _disposition(head[at:headers_end])
        if is_file or name is None:
            return fields, True
        value_at = headers_end + 4
        end = head.find(b"\r\n" + delimiter, value_at)
        if end < 0:
            return fields, False
        if end - value_at <= MAX_FIELD_BYTES:
            fields[name.decode("utf-8", "replace")] = head[value_at:end].decode("utf-8", "replace")
        at = end + 2
    return fields, False


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body exceeds the {limit}-byte limit")


class Upload:
    """The client's body as an async iterator of chunks, for exactly one upstream send.

    `length`: the client's declared Content-Length (None: the body goes on chunked);
    `fields`: the form's leading text fields; `ended`: the client's last body message was
    read (`on_end` is then called once: the proxy starts watching for a disconnect only
    after that, as the body's own messages come through the same `receive`).
    """

    __slots__ = (
        "_head",
        "_limit",
        "_more",
        "_receive",
        "_size",
        "ended",
        "failure",
        "fields",
        "length",
        "on_end",
        "sent",
    )

    def __init__(
        self,
        receive: Receive,
        head: bytes,
        more: bool,
        limit: int,
        length: int | None,
        fields: dict[str, str],
    ) -> None:
        self._receive = receive
        self._head = head
        self._more = more
        self._size = len(head)
        self._limit = limit
        self.length = length
        self.fields = fields
        self.ended = not more
        self.sent = False
        self.failure: Exception | None = None
        self.on_end: Callable[[], None] | None = None

    def __aiter__(self) -> Upload:
        if self.sent:
            raise RuntimeError("a streamed request body cannot be sent twice")
        return self

    async def __anext__(self) -> bytes:
        head = self._head
        if head:
            self._head = b""
            self.sent = True
            return head
        while self._more:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                raise self._fail(ClientGone())
            chunk: bytes = message.get("body", b"")
            self._size += len(chunk)
            if self._size > self._limit:
                raise self._fail(_too_large(self._limit))
            if not message.get("more_body", False):
                self._more = False
                self.ended = True
                if self.on_end is not None:
                    self.on_end()
            if chunk:
                self.sent = True
                return chunk
        raise StopAsyncIteration

    def _fail(self, failure: Exception) -> Exception:
        self._more = False
        self.failure = failure
        return failure


async def open_upload(
    receive: Receive, limit: int, declared_length: int | None, boundary: bytes
) -> Upload:
    """Read the body's first messages (up to the form's first file part, at most about
    `HEAD_BYTES`) and return the `Upload` that sends them and the rest."""
    if declared_length is not None and declared_length > limit:
        raise PayloadTooLarge(
            f"request body of {declared_length} bytes exceeds the {limit}-byte limit"
        )
    chunks: list[bytes] = []
    size = 0
    more = True
    fields: dict[str, str] = {}
    while more and size < HEAD_BYTES:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        more = bool(message.get("more_body", False))
        fields, complete = leading_fields(b"".join(chunks), boundary)
        if complete:
            break
    return Upload(receive, b"".join(chunks), more, limit, declared_length, fields)
