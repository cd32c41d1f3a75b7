"""Multipart forms as the openai SDK lays them out (text fields first, then the file), and
paced senders of them, for upload tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

BOUNDARY = "kvgate-test-boundary"
CONTENT_TYPE = f"multipart/form-data; boundary={BOUNDARY}"


def form(fields: Mapping[str, str], audio: bytes, filename: str = "talk.wav") -> bytes:
    """A form with `fields` and one `file` part holding `audio`."""
    parts = [
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        for name, value in fields.items()
    ]
    parts.append(
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; '
        f'filename="{filename}"\r\nContent-Type: audio/wav\r\n\r\n'.encode()
    )
    return b"".join(parts) + audio + f"\r\n--{BOUNDARY}--\r\n".encode()


async def paced(
    body: bytes,
    split: int | None = None,
    resume: Callable[[], Awaitable[None]] | None = None,
    piece: int = 64 * 1024,
) -> AsyncIterator[bytes]:
    """`body` in pieces (an iterable body: httpx sends it chunked unless told its length):
    the first `split` bytes, then, once `resume()` returned, the rest."""
    split = len(body) if split is None else split
    for at in range(0, split, piece):
        yield body[at : min(at + piece, split)]
        await asyncio.sleep(0)
    if resume is not None:
        await resume()
    for at in range(split, len(body), piece):
        yield body[at : at + piece]
