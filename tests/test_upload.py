"""gateway.upload: the form's leading fields, read from a bounded head, and the streamed body
(limits, disconnects, no replay) over a scripted ASGI `receive`."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import pytest

from gateway.body import ClientGone, check_multipart
from gateway.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType
from gateway.testing.forms import BOUNDARY, form
from gateway.upload import HEAD_BYTES, FieldWatch, Upload, leading_fields, open_upload

B = BOUNDARY.encode()


def _receive(*messages: dict[str, Any]) -> Any:
    queue = list(messages)

    async def receive() -> MutableMapping[str, Any]:
        return queue.pop(0)

    return receive


def _pieces(body: bytes, size: int) -> list[dict[str, Any]]:
    chunks = [body[i : i + size] for i in range(0, len(body), size)]
    return [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]


async def _drain(upload: Upload) -> bytes:
    return b"".join([chunk async for chunk in upload])


def test_leading_fields_stop_at_the_file() -> None:
    body = form({"model": "whisper", "stream": "true"}, b"\0" * 100)
    assert leading_fields(body, B) == ({"model": "whisper", "stream": "true"}, True)
    # A field after the file is not looked for, nor a marker inside the file's bytes.
    trap = form({}, b'name="model"\r\n\r\nfake\r\n', filename="model") + (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="model"\r\n\r\nlate\r\n'.encode()
    )
    assert leading_fields(trap, B) == ({}, True)


@pytest.mark.parametrize("cut", [5, 30, 60, 75])
def test_a_head_cut_inside_a_field_is_incomplete(cut: int) -> None:
    body = form({"model": "whisper"}, b"x")
    fields, complete = leading_fields(body[:cut], B)
    assert not complete and fields == {}


def test_long_fields_are_not_kept_and_unquoted_names_are_read() -> None:
    body = (
        f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=prompt\r\n\r\n".encode()
        + b"p" * 600
        + f"\r\n--{BOUNDARY}\r\ncontent-disposition: form-data; NAME=model\r\n\r\nm\r\n".encode()
        + f"--{BOUNDARY}--\r\n".encode()
    )
    assert leading_fields(body, B) == ({"model": "m"}, True)


def test_check_multipart_returns_the_boundary() -> None:
    assert check_multipart(b'multipart/form-data; boundary="a b"') == b"a b"
    assert check_multipart(b"multipart/form-data; charset=x; boundary=xyz") == b"xyz"
    for bad in (None, b"application/json", b"multipart/form-data"):
        with pytest.raises(UnsupportedMediaType):
            check_multipart(bad)


async def test_upload_reads_a_bounded_head_then_streams_the_rest() -> None:
    body = form({"model": "whisper"}, bytes(range(256)) * 4096)  # ~1 MB
    messages = _pieces(body, 16 * 1024)
    receive = _receive(*messages)
    upload = await open_upload(receive, 2 << 20, len(body), B)
    # One message held the fields and the file's part headers: nothing more was read.
    assert upload.fields == {"model": "whisper"} and not upload.ended and not upload.sent
    ends: list[bool] = []
    upload.on_end = lambda: ends.append(True)
    assert await _drain(upload) == body
    assert upload.ended and upload.sent and ends == [True] and upload.length == len(body)
    with pytest.raises(RuntimeError):
        aiter(upload)  # a streamed body is sent once


async def test_head_reading_is_bounded_without_a_file_part() -> None:
    junk = b"no form here" * 20_000
    messages = _pieces(junk, 8 * 1024)
    upload = await open_upload(_receive(*messages), 1 << 20, None, B)
    assert upload.fields == {} and HEAD_BYTES <= len(upload._head) < HEAD_BYTES + 8 * 1024
    assert await _drain(upload) == junk


async def test_limits_and_disconnects() -> None:
    with pytest.raises(PayloadTooLarge):
        await open_upload(_receive(), 100, 101, B)  # declared: refused before reading
    body = form({"model": "m"}, b"z" * 5000)
    upload = await open_upload(_receive(*_pieces(body, 1000)), 3000, None, B)
    with pytest.raises(PayloadTooLarge):
        await _drain(upload)
    assert isinstance(upload.failure, PayloadTooLarge) and not upload.ended
    gone = await open_upload(
        _receive(*_pieces(body, 1000)[:2], {"type": "http.disconnect"}), 1 << 20, None, B
    )
    with pytest.raises(ClientGone):
        await _drain(gone)
    assert isinstance(gone.failure, ClientGone)
    with pytest.raises(ClientGone):
        await open_upload(_receive({"type": "http.disconnect"}), 1 << 20, None, B)


def _field(name: str, value: str) -> bytes:
    return (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
    )


def _with_tail(fields: dict[str, str], audio: bytes, tail: bytes) -> bytes:
    """`form(fields, audio)` with `tail` parts after the file, before the closing line."""
    body = form(fields, audio)
    closing = f"--{BOUNDARY}--\r\n".encode()
    return body[: -len(closing)] + tail + closing


@pytest.mark.parametrize("piece", [7, 64, 1000, 10**6])
@pytest.mark.parametrize(
    ("body", "param"),
    [
        (form({"model": "a", "language": "en"}, b"\0" * 300), None),
        (_with_tail({"model": "a"}, b"\0" * 300, _field("model", "b")), "model"),
        (_with_tail({}, b"\0" * 300, _field("model", "b")), "model"),
        (_with_tail({"model": "a"}, b"\0" * 300, _field("stream", "true")), "stream"),
        (_with_tail({"model": "a"}, b"\0" * 300, _field("language", "en")), None),
        (form({"model": "a", "language": "en"}, b"") + _field("language", "fr"), "language"),
        (
            _with_tail(
                {"model": "a", "timestamp_granularities[]": "word"},
                b"\0" * 30,
                _field("timestamp_granularities[]", "segment"),
            ),
            None,
        ),
    ],
)
def test_field_watch_refuses_repeats_and_needed_fields_after_the_file(
    body: bytes, param: str | None, piece: int
) -> None:
    watch = FieldWatch(B)
    refused = None
    for at in range(0, len(body), piece):
        refused = refused or watch.feed(body[at : at + piece])
    assert (refused.param if refused is not None else None) == param
    if refused is not None:
        assert refused.status == 400


async def test_a_repeat_in_the_streamed_part_fails_the_upload() -> None:
    audio = b"\0" * (HEAD_BYTES * 2)
    body = _with_tail({"model": "a"}, audio, _field("model", "b"))
    upload = await open_upload(_receive(*_pieces(body, 16 * 1024)), 10**9, None, B)
    assert upload.fields == {"model": "a"}
    with pytest.raises(BadRequest) as info:
        await _drain(upload)
    assert upload.failure is info.value and info.value.param == "model"


async def test_a_repeat_in_the_head_is_refused_before_anything_is_sent() -> None:
    body = _field("model", "a") + _field("model", "b") + form({}, b"x")
    with pytest.raises(BadRequest):
        await open_upload(_receive(*_pieces(body, 10**6)), 10**9, None, B)
