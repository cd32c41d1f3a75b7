"""An aborted request is counted, not logged as an error with a traceback (issue 19, item 8)."""

from __future__ import annotations

import asyncio
import logging

import httpx

from gateway.testing.servers import sim_engines


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def test_client_disconnects_leave_no_traceback() -> None:
    errors = _Errors()
    logger = logging.getLogger("uvicorn.error")
    try:
        async with sim_engines(1, "tiny") as engines:
            logger.addHandler(errors)  # after start-up: uvicorn's logging config drops handlers
            body = {
                "model": "kvgate-sim",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 500,
            }
            async with httpx.AsyncClient(base_url=engines[0].url) as http:
                try:
                    await http.post(
                        "/v1/chat/completions", json=body, timeout=httpx.Timeout(5.0, read=0.1)
                    )
                except httpx.ReadTimeout:
                    pass
                async with http.stream(
                    "POST", "/v1/chat/completions", json={**body, "stream": True}
                ) as resp:
                    async for _ in resp.aiter_lines():
                        break
            for _ in range(100):
                if engines[0].aborted >= 2:
                    break
                await asyncio.sleep(0.01)
            assert engines[0].aborted == 2
    finally:
        logger.removeHandler(errors)
    assert errors.records == [], [r.getMessage() for r in errors.records]
