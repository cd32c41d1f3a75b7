"""The floor under kvgate's request path: uvicorn with kvgate's server options and its `h1`
upstream client, forwarding every POST to one engine and relaying the answer, and nothing
else (no routing, metrics, accounting, disconnect watch or error handling).

`bench_routers.py --routers kvgate,floor` runs it beside kvgate: the difference is what
kvgate's own work costs per request, the rest is the server and the client it is built on.

    FLOOR_ENGINE=http://127.0.0.1:8001 python loadtests/floor_app.py PORT
"""

from __future__ import annotations

import os
import sys
from typing import Any

import uvicorn

from gateway.scope import HEAD_HOLDER_KEY
from gateway.settings import ServerSettings
from gateway.upstream import make_client, response_headers
from gateway.upstream.base import Timeouts

ENGINE = os.environ.get("FLOOR_ENGINE", "http://127.0.0.1:8001")
_SSE = b"text/event-stream"


class Floor:
    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.client = make_client("h1", Timeouts())

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    await self.client.aclose()
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = [(b"content-type", b"application/json")]
        resp = await self.client.send("POST", self.engine + scope["path"], headers, body)
        out = response_headers(resp.headers)
        holder = scope.get(HEAD_HOLDER_KEY)  # as kvgate's relay: head and body in one write
        try:
            if next((v for n, v in out if n == b"content-type"), b"").startswith(_SSE):
                if holder is not None:
                    holder.hold()  # kvgate sends the head once the first chunk is in, too
                await send({"type": "http.response.start", "status": resp.status, "headers": out})
                async for chunk in resp.iter_bytes():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
            else:
                data = await resp.read()
                out.append((b"content-length", b"%d" % len(data)))
                if holder is not None:
                    holder.hold()
                await send({"type": "http.response.start", "status": resp.status, "headers": out})
                await send({"type": "http.response.body", "body": data})
        finally:
            await resp.aclose()


def main() -> None:
    server = ServerSettings()
    uvicorn.run(
        Floor(ENGINE),
        host="127.0.0.1",
        port=int(sys.argv[1]),
        loop="uvloop",
        http=server.protocol(),
        log_level="warning",
        access_log=False,
        proxy_headers=False,
        server_header=False,
        date_header=False,
        lifespan="on",
    )


if __name__ == "__main__":
    main()
