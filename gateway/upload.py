"""Request bodies forwarded as they arrive (multipart audio): never held whole.

`open_upload` reads the first few ASGI messages only, until the form's leading text fields
are in hand (the SDKs put `model`, `language`, `stream` ... before the file) or `HEAD_BYTES`
were read. The returned `Upload` is the body the upstream client sends: those first bytes,
then the rest of the client's body message by message, so the gateway holds one message
(uvicorn's read size) at a time, however large the file.

The body limit holds while streaming: a declared `Content-Length` over it is refused before
anything is read, a chunked body that grows past it fails the upload (`failure`), which
aborts the engine's connection and answers 413 when the engine has not answered yet.

Every part's name is watched as the body goes by: a field given twice, or a field the
gateway decides on (`model`, `stream`) placed after the file, fails the upload with a 400
(the engine's form parser would serve the last value, the gateway checked the first).

A streamed body cannot be replayed: `sent` says whether any byte went to the upstream
client, after which the proxy retries nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from gateway.asgi import Receive
from gateway.body import ClientGone
from gateway.errors import BadRequest, PayloadTooLarge

# How far into a form the gateway looks for its leading text fields (routing reads only
# these); past them `FieldWatch` refuses a repeated field, or a needed one after the file.
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


# Fields the gateway decides on (the key's models, routing): one placed after the file would
# be served by the engine without the gateway having seen it.
NEEDED_FIELDS = frozenset({"model", "stream"})
# Part headers longer than this are not looked into (no SDK writes more than a few lines).
_MAX_PART_HEADERS = 4096


class FieldWatch:
    """Every part's name as the body goes by, whatever the chunking: a name seen twice (but
    for array fields, `name[]`) or a needed field after the first file is refused. Engines'
    form parsers keep the last value of a field, the gateway the first: both must be one."""

    __slots__ = ("_carry", "_delimiter", "_file_seen", "_seen")

    def __init__(self, boundary: bytes) -> None:
        self._delimiter = b"\r\n--" + boundary
        self._carry = b"\r\n"  # the opening delimiter has no line break before it
        self._seen: set[str] = set()
        self._file_seen = False

    def feed(self, chunk: bytes) -> BadRequest | None:
        data = self._carry + chunk
        delimiter = self._delimiter
        pos = 0
        while True:
            at = data.find(delimiter, pos)
            if at < 0:
                self._carry = data[max(pos, len(data) - len(delimiter) + 1) :]
                return None
            start = at + len(delimiter)
            end = data.find(b"\r\n\r\n", start)
            if end < 0:
                if len(data) - start <= _MAX_PART_HEADERS:
                    self._carry = data[at:]
                    return None
                pos = start
                continue
            name, is_file = _disposition(data[start:end])
            pos = end + 4
            if name is None:
                continue
            text = name.decode("utf-8", "replace")
            if text in self._seen and not text.endswith("[]"):
                return BadRequest(f"form field `{text}` appears more than once", param=text)
            if self._file_seen and text in NEEDED_FIELDS:
                return BadRequest(
                    f"form field `{text}` must come before the file, as the SDKs send it",
                    param=text,
                )
            self._seen.add(text)
            self._file_seen = self._file_seen or is_file


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
        "_watch",
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
        watch: FieldWatch | None = None,
    ) -> None:
        self._receive = receive
        self._watch = watch
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
                if self._watch is not None and (refused := self._watch.feed(chunk)) is not None:
                    raise self._fail(refused)
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
    head = b"".join(chunks)
    watch = FieldWatch(boundary)
    refused = watch.feed(head)
    if refused is not None:
        raise refused
    return Upload(receive, head, more, limit, declared_length, fields, watch)
