"""gateway.testing.forms against the real thing: the form the official openai client sends
(captured on a loopback server) and the pacing of a streamed upload as a server receives it."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from gateway.asgi import Message, Receive, Scope, Send
from gateway.serving import RunningServer, start_server
from gateway.testing.forms import BOUNDARY, CONTENT_TYPE, form, paced
from gateway.upload import leading_fields


class Capture:
    """An ASGI app keeping each request's body as the pieces it arrived in."""

    def __init__(self) -> None:
        self.pieces: list[list[bytes]] = []
        self.arrived: list[float] = []  # when each piece of every request came
        self.content_types: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        pieces: list[bytes] = []
        more = True
        while more:
            message: Message = await receive()
            if message["body"]:
                pieces.append(message["body"])
                self.arrived.append(time.monotonic())
            more = message.get("more_body", False)
        self.pieces.append(pieces)
        self.content_types.append(dict(scope["headers"]).get(b"content-type", b"").decode())
        body = b'{"text": "ok"}'
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})


@pytest.fixture
async def capture() -> AsyncIterator[tuple[Capture, RunningServer]]:
    app = Capture()
    server = await start_server(app)
    try:
        yield app, server
    finally:
        await server.stop()


def _parts(body: bytes, boundary: bytes) -> list[tuple[bytes, bytes]]:
    """(headers, content) of each part, in order."""
    out = []
    for raw in body.split(b"--" + boundary)[1:-1]:
        head, _, content = raw.strip(b"\r\n").partition(b"\r\n\r\n")
        out.append((head, content))
    return out


def _name(head: bytes) -> bytes:
    found = re.search(rb'name="([^"]*)"', head)
    assert found is not None, head
    return found.group(1)


async def test_the_form_is_laid_out_as_the_official_client_lays_it_out(
    capture: tuple[Capture, RunningServer],
) -> None:
    app, server = capture
    audio = b"RIFF" + bytes(range(256)) * 4
    async with openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="-", max_retries=0
    ) as client:
        await client.audio.transcriptions.create(
            model="whisper", file=("talk.wav", audio, "audio/wav"), language="en"
        )
    sent = b"".join(app.pieces[0])
    boundary = re.search(r"boundary=([^;]+)", app.content_types[0])
    assert boundary is not None
    theirs = _parts(sent, boundary.group(1).strip('"').encode())
    ours = _parts(form({"model": "whisper", "language": "en"}, audio), BOUNDARY.encode())
    # The same parts in the same order: text fields first, then the file, bytes intact.
    assert [_name(h) for h, _ in ours] == [_name(h) for h, _ in theirs]
    assert [c for _, c in ours] == [c for _, c in theirs]
    assert b'filename="talk.wav"' in theirs[-1][0] and b'filename="talk.wav"' in ours[-1][0]
    # What the gateway reads of a form (its leading fields) is the same for both.
    boundary_bytes = boundary.group(1).strip('"').encode()
    assert leading_fields(sent, boundary_bytes) == leading_fields(
        form({"model": "whisper", "language": "en"}, audio), BOUNDARY.encode()
    )


async def test_paced_sends_the_head_then_waits_for_resume_then_the_rest(
    capture: tuple[Capture, RunningServer],
) -> None:
    app, server = capture
    body = form({"model": "whisper"}, bytes(300_000))
    resumed: list[float] = []

    async def resume() -> None:
        await asyncio.sleep(0.2)  # long enough for the head to reach the server first
        resumed.append(time.monotonic())

    async with httpx.AsyncClient(base_url=server.url) as http:
        answer = await http.post(
            "/v1/audio/transcriptions",
            content=paced(body, split=100_000, resume=resume, piece=16_384),
            headers={"content-type": CONTENT_TYPE},
        )
    assert answer.status_code == 200 and resumed
    assert b"".join(app.pieces[0]) == body
    # Exactly the head had arrived when `resume` returned; the rest came after it.
    before = [p for p, t in zip(app.pieces[0], app.arrived) if t < resumed[0]]
    assert sum(len(p) for p in before) == 100_000


async def test_paced_without_a_split_sends_everything_in_order() -> None:
    body = bytes(range(256)) * 1000
    pieces = [p async for p in paced(body, piece=10_000)]
    assert b"".join(pieces) == body
    assert [len(p) for p in pieces[:-1]] == [10_000] * (len(pieces) - 1)
