"""One generation request on a `SimEngine`: PD preparation, engine submission, and the
streamed or buffered answer, raced against the client's disconnect (which aborts the
request in the engine and frees its KV blocks, as vLLM does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import httpx
import orjson
import xxhash
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.sim.apis import (
    ResponsesStream,
    anthropic_error,
    event,
    message_closing,
    message_delta,
    message_object,
    message_opening,
    response_object,
)
from gateway.sim.engine import RequestHandle, RequestRejected, SimRequest
from gateway.sim.runner import EngineStopped
from gateway.sim.wire import (
    SSE_DONE,
    OutputText,
    ParsedRequest,
    chunk,
    error_body,
    full_response,
    mid_stream_error,
    usage,
    usage_chunk,
)
from gateway.types import Role

if TYPE_CHECKING:
    from gateway.sim.server import RequestRecord, SimEngine

log = logging.getLogger(__name__)

_BOOTSTRAP_POLL_S = 0.005


class _PDFailed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class Generation(Response):
    """An ASGI response that does the work itself so it can notice the client leaving."""

    def __init__(self, engine: SimEngine, parsed: ParsedRequest, request_id: str) -> None:
        # Response.__init__ would render a body; this class streams its own.
        self.background = None
        self.engine = engine
        self.parsed = parsed
        self.rid = request_id
        self.handle: RequestHandle | None = None
        self.started = False
        self.record: RequestRecord | None = None
        self.query = ""
        self.uid = uuid.uuid4().hex  # the Responses / Messages object id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.query = scope.get("query_string", b"").decode("latin-1")
        work = asyncio.ensure_future(self._run(send))
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                if watch.done() and not watch.cancelled():
                    self._client_gone()
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
        if not work.cancelled():  # cancelled: the client left, which is counted, not an error
            work.result()

    def _client_gone(self) -> None:
        self.engine.metrics.client_disconnects += 1
        if self.record is not None:
            self.record.disconnected = True

    # ---- the work ----------------------------------------------------------------------
    async def _run(self, send: Send) -> None:
        from gateway.sim.server import RequestRecord

        engine, p = self.engine, self.parsed
        self.record = record = RequestRecord(
            self.rid, p.kind, status=200, priority=p.priority, query=self.query
        )
        engine.request_log.append(record)
        try:
            try:
                request, pd, kv_out = await self._prepare()
            except _PDFailed as exc:
                record.status = exc.status
                await self._send_error(send, exc.status, exc.message)
                return
            record.pd = pd
            record.prompt_tokens = request.prompt_tokens
            try:
                self.handle = engine.runner.submit(request)
            except RequestRejected as exc:
                record.status = 400
                await self._send_error(send, 400, str(exc))
                return
            except EngineStopped as exc:
                record.status = 500
                await self._send_error(send, 500, str(exc))
                return
            if p.stream:
                await self._stream(send, request)
            else:
                await self._buffered(send, request, kv_out)
        finally:
            self._settle(record)

    def _settle(self, record: RequestRecord) -> None:
        handle = self.handle
        if handle is not None:
            if not handle.finished:
                self.engine.runner.abort(handle)
            record.cached_tokens = handle.cached_tokens or 0
            record.output_tokens = handle.output_tokens
            record.finish_reason = handle.finish_reason
            record.preemptions = handle.num_preemptions
            record.transfer_bytes = handle.transfer_bytes

    async def detached(self) -> None:
        """A `background: true` Response, generated with no client attached: the stored
        object tells how far it is, and `cancel` cancels this coroutine (which aborts it)."""
        from gateway.sim.server import RequestRecord

        engine, p = self.engine, self.parsed
        self.record = record = RequestRecord(self.rid, p.kind, status=200, priority=p.priority)
        engine.request_log.append(record)
        try:
            request, _, _ = await self._prepare()
            record.prompt_tokens = request.prompt_tokens
            self.handle = handle = engine.runner.submit(request)
            engine.responses.set_status(self.api_id, "in_progress")
            await engine.runner.wait(handle)
            self._api_object(
                OutputText(engine.seed, request.output_seed).take(handle.output_tokens)
            )
        except (_PDFailed, RequestRejected, EngineStopped) as exc:
            record.status = 500
            engine.responses.set_status(self.api_id, "failed", str(exc))
        finally:
            self._settle(record)

    async def _prepare(self) -> tuple[SimRequest, str | None, dict[str, Any] | None]:
        engine, p = self.engine, self.parsed
        tokens, hashes = engine.model.prompt_from_text(p.text, p.cache_salt)
        seed = xxhash.xxh64_intdigest(p.text.encode("utf-8", "surrogatepass"))
        kv = p.kv_transfer_params or {}
        if self.record is not None:
            self.record.kv_transfer_params = dict(kv) if kv else None
        max_tokens = p.max_tokens
        remote_kv = hold = False
        pd: str | None = None
        kv_out: dict[str, Any] | None = None
        transfer_id = kv.get("transfer_id")
        if kv.get("do_remote_decode") and isinstance(transfer_id, str):
            # vLLM's Mooncake connector: the router named the transfer; no params back.
            pd, hold, max_tokens = "prefill", True, 1
            engine.transfers[transfer_id] = self.rid
        elif kv.get("do_remote_decode"):
            pd, hold, max_tokens = "prefill", True, 1
            kv_out = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": engine.engine_id,
                "remote_block_ids": [],
                "remote_host": engine.host,
                "remote_port": engine.port,
                "remote_request_id": self.rid,
                "tp_size": 1,
            }
        elif kv.get("do_remote_prefill"):
            pd = "decode"
            remote_kv = await self._pull_vllm(kv)
        elif p.bootstrap is not None and engine.role is Role.PREFILL:
            pd, hold, max_tokens = "prefill", True, 1
            engine.rooms[p.bootstrap.room] = self.rid
        elif p.bootstrap is not None and engine.role is Role.DECODE:
            pd = "decode"
            await self._wait_bootstrap()
            remote_kv = True
        request = SimRequest(
            request_id=self.rid,
            prompt_tokens=tokens,
            block_hashes=hashes,
            token_ids=engine.model.token_ids(p.text),
            max_tokens=max_tokens,
            priority=p.priority,
            ignore_eos=p.ignore_eos,
            output_seed=seed,
            remote_kv=remote_kv,
            hold_kv=hold,
        )
        return request, pd, kv_out

    async def _pull_vllm(self, kv: Mapping[str, Any]) -> bool:
        """Fetch (and release) the prefill leg's KV; on failure recompute locally."""
        engine = self.engine
        host, port = kv.get("remote_host"), kv.get("remote_port")
        remote_rid = kv.get("remote_request_id") or self.rid
        addr, transfer_id = kv.get("remote_bootstrap_addr"), kv.get("transfer_id")
        if isinstance(addr, str) and isinstance(transfer_id, str) and engine.http is not None:
            url = f"{addr}/sim/kv/{transfer_id}"  # Mooncake: from the prefill's bootstrap
        elif not isinstance(host, str) or not isinstance(port, int) or engine.http is None:
            engine.kv_pull_failures += 1
            return False
        else:
            url = f"http://{host}:{port}/sim/kv/{remote_rid}"
        try:
            resp = await engine.http.get(url)
        except httpx.HTTPError as exc:
            log.warning("KV pull from %s:%s failed: %s; recomputing", host, port, exc)
            engine.kv_pull_failures += 1
            return False
        if resp.status_code != 200:
            engine.kv_pull_failures += 1
            return False
        return True

    async def _wait_bootstrap(self) -> None:
        engine, b = self.engine, self.parsed.bootstrap
        assert b is not None and engine.http is not None
        url = f"http://{b.host}:{b.port}/sim/bootstrap/{b.room}"
        deadline = time.monotonic() + engine.bootstrap_timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError):
                resp = await engine.http.get(url)
                if resp.status_code == 200:
                    return
            if time.monotonic() >= deadline:
                engine.kv_pull_failures += 1
                raise _PDFailed(
                    500, f"KV bootstrap for room {b.room} timed out at {b.host}:{b.port}"
                )
            await asyncio.sleep(_BOOTSTRAP_POLL_S)

    async def _stall(self) -> None:
        """Keep the connection open, sending nothing, until the client or the engine goes."""
        engine = self.engine
        engine.faults.stalled += 1
        if self.handle is not None:
            engine.runner.abort(self.handle)
        await engine.closing.wait()

    async def _start(self, send: Send, content_type: bytes, status: int = 200) -> None:
        self.started = True
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", content_type), (b"cache-control", b"no-cache")],
            }
        )

    async def _send_error(self, send: Send, status: int, message: str) -> None:
        body = (
            anthropic_error(status, message)
            if self.parsed.kind == "messages"
            else error_body(status, message)
        )
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def _buffered(
        self, send: Send, request: SimRequest, kv_out: dict[str, Any] | None
    ) -> None:
        engine, p, handle = self.engine, self.parsed, self.handle
        assert handle is not None
        if engine.faults.config.stall is not None:
            await self._stall()
            return
        try:
            await engine.runner.wait(handle)
        except EngineStopped as exc:
            await self._send_error(send, 500, str(exc))
            return
        text = OutputText(engine.seed, request.output_seed).take(handle.output_tokens)
        use = usage(handle.prompt_tokens, handle.output_tokens, handle.cached_tokens or 0)
        if kv_out is not None:
            kv_out["remote_block_ids"] = list(handle.held_blocks)
        if p.kind in ("responses", "messages"):
            body = orjson.dumps(self._api_object(text))
        else:
            finish = "length" if engine.faults.fails_hard(p.text) else handle.finish_reason
            body = orjson.dumps(
                full_response(p.kind, self.rid, engine.model_name, text, finish, use, kv_out)
            )
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _api_object(self, text: str) -> dict[str, Any]:
        engine, p, handle = self.engine, self.parsed, self.handle
        assert handle is not None and p.echo is not None
        counts = (handle.prompt_tokens, handle.output_tokens, handle.cached_tokens or 0)
        if p.kind == "messages":
            return message_object(
                self.api_id, engine.model_name, text, handle.finish_reason, *counts
            )
        answer = response_object(
            self.api_id,
            engine.model_name,
            p.echo,
            text=text,
            finish_reason=handle.finish_reason,
            prompt_tokens=counts[0],
            output_tokens=counts[1],
            cached_tokens=counts[2],
        )
        engine.store_response(self.api_id, p, text, answer)
        return answer

    @property
    def api_id(self) -> str:
        return ("msg_" if self.parsed.kind == "messages" else "resp_") + self.uid

    async def _stream_api(self, send: Send, request: SimRequest) -> None:
        """Responses / Messages events: the opening ones with the first token (as for chat's
        role chunk, the first byte then marks the TTFT), one delta per token, the closing."""
        engine, p, handle = self.engine, self.parsed, self.handle
        assert handle is not None and p.echo is not None
        out = OutputText(engine.seed, request.output_seed)
        responses = ResponsesStream(self.api_id, engine.model_name, p.echo)
        await self._start(send, b"text/event-stream")
        if engine.faults.config.stall == 0:
            await self._stall()
            return
        sent = 0
        try:
            async for n in engine.runner.stream(handle):
                events: list[bytes] = []
                if sent == 0:
                    events.append(
                        message_opening(
                            self.api_id,
                            engine.model_name,
                            handle.prompt_tokens,
                            handle.cached_tokens or 0,
                        )
                        if p.kind == "messages"
                        else responses.opening()
                    )
                for _ in range(n):
                    stall_at = engine.faults.config.stall
                    if stall_at is not None and sent >= stall_at:
                        if events:
                            await send(
                                {
                                    "type": "http.response.body",
                                    "body": b"".join(events),
                                    "more_body": True,
                                }
                            )
                        await self._stall()
                        return
                    sent += 1
                    text = out.take(1)
                    events.append(
                        message_delta(text) if p.kind == "messages" else responses.delta(text)
                    )
                await send(
                    {"type": "http.response.body", "body": b"".join(events), "more_body": True}
                )
        except EngineStopped as exc:
            failure = (
                event("error", orjson.loads(anthropic_error(500, str(exc))))
                if p.kind == "messages"
                else responses.error("engine_stopped", str(exc))
            )
            await send({"type": "http.response.body", "body": failure, "more_body": False})
            return
        if p.kind == "messages":
            closing = message_closing(
                handle.finish_reason,
                handle.prompt_tokens,
                handle.output_tokens,
                handle.cached_tokens or 0,
            )
        else:
            closing = responses.closing(
                handle.finish_reason,
                handle.prompt_tokens,
                handle.output_tokens,
                handle.cached_tokens or 0,
            )
            engine.store_response(self.api_id, p, "".join(responses.text), responses.final)
        await send({"type": "http.response.body", "body": closing, "more_body": False})

    async def _stream(self, send: Send, request: SimRequest) -> None:
        if self.parsed.kind in ("responses", "messages"):
            await self._stream_api(send, request)
            return
        engine, p, handle = self.engine, self.parsed, self.handle
        assert handle is not None
        kind, rid, model = p.kind, self.rid, engine.model_name
        created = int(time.time())
        out = OutputText(engine.seed, request.output_seed)
        null_usage = p.include_usage

        def use(completion: int | None = None) -> dict[str, Any]:
            done = handle.output_tokens if completion is None else completion
            return usage(handle.prompt_tokens, done, handle.cached_tokens or 0)

        await self._start(send, b"text/event-stream")

        async def body(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        stall_at = engine.faults.config.stall
        if stall_at == 0:
            await self._stall()
            return
        sent = 0
        try:
            async for n in engine.runner.stream(handle):
                # One SSE event per token, but one write per delivery: tokens that arrive
                # together (instant profile, a late wake-up) go out in one send.
                events: list[bytes] = []
                if sent == 0 and kind == "chat":
                    # As vLLM does, the role chunk goes out with the first token, after the
                    # prefill: a client's (or the gateway's) first byte then marks the TTFT.
                    events.append(
                        chunk(
                            kind,
                            rid,
                            model,
                            created,
                            text="",
                            role=True,
                            with_usage_null=null_usage,
                        )
                    )
                for _ in range(n):
                    stall_at = engine.faults.config.stall
                    if stall_at is not None and sent >= stall_at:
                        if events:
                            await body(b"".join(events))
                        await self._stall()
                        return
                    sent += 1
                    last = handle.finished and sent == handle.output_tokens
                    events.append(
                        chunk(
                            kind,
                            rid,
                            model,
                            created,
                            text=out.take(1),
                            finish_reason=handle.finish_reason if last else None,
                            with_usage_null=null_usage,
                            # The tokens sent so far, this one included: several may
                            # arrive in one delivery, each chunk counts up by one (vLLM).
                            use=use(sent) if p.continuous_usage else None,
                        )
                    )
                await body(b"".join(events))
        except EngineStopped as exc:
            await body(mid_stream_error(500, str(exc)))
            await body(SSE_DONE)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if p.include_usage:
            await body(usage_chunk(kind, rid, model, created, use()))
        await body(SSE_DONE)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
