"""`/v1/audio/speech` on the simulated engine: a WAV whose length grows with the text
(24 kHz, 16-bit mono, 60 ms a character, about 2.9 KB), sent in parts as a TTS engine
produces it, with its Content-Length.

The samples are deterministic noise seeded by the text, so equal requests get equal bytes;
the engine keeps the sha256 and size of every body it sent whole (`SimEngine.speeches`)
and counts bytes as they go out (`speech_bytes_sent`). A test may hold the last part back
(`SimEngine.speech_hold`, an `asyncio.Event`) to see what reached the client before the
engine finished. A client leaving stops the body and is counted as a disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import struct
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import orjson
import xxhash
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.sim.wire import WireError

if TYPE_CHECKING:
    from gateway.sim.server import SimEngine

RATE = 24_000
SAMPLES_PER_CHAR = RATE * 60 // 1000
PART_BYTES = 64 * 1024


def _input(raw: bytes) -> str:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise WireError(400, f"invalid JSON body: {exc}") from None
    text = body.get("input") if isinstance(body, dict) else None
    if not isinstance(text, str):
        raise WireError(400, "'input' must be a string", "input")
    return text


def wav_parts(text: str, part_bytes: int = PART_BYTES) -> tuple[int, Iterator[bytes]]:
    """(total size, the body's parts): the RIFF header, then the samples."""
    size = 2 * SAMPLES_PER_CHAR * max(1, len(text))
    header = (
        b"RIFF"
        + struct.pack("<I", 36 + size)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, RATE, RATE * 2, 2, 16)
        + b"data"
        + struct.pack("<I", size)
    )

    def parts() -> Iterator[bytes]:
        yield header
        rng = random.Random(xxhash.xxh64_intdigest(text.encode("utf-8", "surrogatepass")))
        left = size
        while left:
            n = min(part_bytes, left)
            left -= n
            yield rng.randbytes(n)

    return len(header) + size, parts()


class SpeechResponse(Response):
    """The WAV as an ASGI response that sends it part by part."""

    def __init__(self, engine: SimEngine, raw: bytes) -> None:
        self.background = None
        self.engine = engine
        self.total, self.parts = wav_parts(_input(raw))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.ensure_future(self._send(send))
        watch = asyncio.ensure_future(_client_gone(receive))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                self.engine.metrics.client_disconnects += 1
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
        if not work.cancelled():
            work.result()

    async def _send(self, send: Send) -> None:
        engine = self.engine
        headers = [(b"content-type", b"audio/wav"), (b"content-length", b"%d" % self.total)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        digest = hashlib.sha256()
        part = next(self.parts)
        for following in self.parts:
            digest.update(part)
            await send({"type": "http.response.body", "body": part, "more_body": True})
            engine.speech_bytes_sent += len(part)
            part = following
            await asyncio.sleep(0)  # one part per loop turn, as a TTS engine yields them
        hold = engine.speech_hold
        if hold is not None:
            await hold.wait()
        digest.update(part)
        await send({"type": "http.response.body", "body": part, "more_body": False})
        engine.speech_bytes_sent += len(part)
        engine.speeches.append((digest.hexdigest(), self.total))


async def _client_gone(receive: Receive) -> Any:
    while (await receive())["type"] != "http.disconnect":
        pass
