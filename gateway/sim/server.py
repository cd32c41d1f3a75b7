"""`SimEngine`: one simulated replica (engine model + runner + metrics + faults) and its
Starlette app with vLLM's HTTP surface (see gateway.sim.wire for the bodies).

Endpoints: POST /v1/chat/completions, /v1/completions, /v1/embeddings; GET /v1/models,
/health, /metrics; POST|GET /admin/faults; POST /reset_prefix_cache; GET /sim/state;
POST /sim/drop_cache (the cache an engine restart loses, dropped while requests run).
PD hand-off (sim-only transport standing in for NIXL / Mooncake): GET /sim/kv/{request_id}
(a decode engine pulls and releases a prefill leg's KV) and GET /sim/bootstrap/{room}
(SGLang-style rendezvous on the prefill engine's own HTTP port).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.kvevents.wire import EventBatch, Layout
from gateway.serving import RunningServer, start_server
from gateway.sim import extras
from gateway.sim.apis import (
    anthropic_error,
    anthropic_messages,
    response_object,
    responses_messages,
)
from gateway.sim.clock import RealClock
from gateway.sim.engine import EngineModel
from gateway.sim.faults import NO_FAULTS, FaultConfig, FaultState
from gateway.sim.generate import Generation
from gateway.sim.kvpublish import KVEventPublisher
from gateway.sim.metrics import CONTENT_TYPE, Flavor, SimMetrics
from gateway.sim.middleware import EchoRequestId, RecordHeaders, RequireApiKey
from gateway.sim.profiles import HardwareProfile
from gateway.sim.runner import EngineRunner
from gateway.sim.speech import SpeechResponse
from gateway.sim.stored import ResponseStore
from gateway.sim.tokenizer import Tokenizer
from gateway.sim.wire import (
    Kind,
    ParsedRequest,
    WireError,
    embeddings,
    error_body,
    parse_generation,
)
from gateway.types import Role

log = logging.getLogger(__name__)

DEFAULT_BOOTSTRAP_TIMEOUT_S = 30.0
DEFAULT_REQUEST_LOG_SIZE = 10_000
# vLLM (VLLM_HTTP_TIMEOUT_KEEP_ALIVE) and SGLang (its uvicorn.run) close a connection idle
# this long: a client that calls less often opens a new connection each time.
ENGINE_KEEP_ALIVE_S = 5.0


@dataclass(slots=True)
class RequestRecord:
    """One served generation request, for tests and the CLI's state endpoint."""

    request_id: str
    endpoint: str
    status: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    priority: int = 0
    pd: str | None = None
    disconnected: bool = False
    preemptions: int = 0
    transfer_bytes: int = 0
    query: str = ""  # the request's query string, as received
    # What the request carried that steers the engine (tests read what reached it).
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class KVEventsOptions:
    """A simulated engine's `--kv-events-config`: ports are picked at start
    (`SimEngine.kv_publisher.endpoint` / `.replay_endpoint`)."""

    topic: str = "kv-events"
    replay: bool = True
    buffer_steps: int = 10_000
    layout: Layout = "mixed"  # what vLLM 0.33 and SGLang 0.5.23 send
    host: str = "127.0.0.1"


class SimEngine:
    """One simulated replica. Tests read `model`, `aborted`, `blocks_in_use`, `request_log`."""

    def __init__(
        self,
        profile: HardwareProfile,
        *,
        index: int = 0,
        model_name: str = "kvgate-sim",
        flavor: Flavor = "vllm",
        seed: int = 0,
        time_scale: float = 1.0,
        role: Role = Role.BOTH,
        priority_scheduling: bool = False,
        faults: FaultConfig = NO_FAULTS,
        bootstrap_timeout_s: float = DEFAULT_BOOTSTRAP_TIMEOUT_S,
        request_log_size: int = DEFAULT_REQUEST_LOG_SIZE,
        tokenizer: Tokenizer | None = None,
        api_key: str | None = None,
        kv_events: KVEventsOptions | None = None,
        metrics_enabled: bool = True,
        low_priority_first: bool = False,
        lora_modules: tuple[str, ...] = (),
        keep_alive_s: float = ENGINE_KEEP_ALIVE_S,
    ) -> None:
        self.index = index
        self.keep_alive_s = keep_alive_s
        # vLLM's --lora-modules names: served (listed with the base model as `parent`) and
        # answered as the base model is (the simulator computes no adapter).
        self.lora_modules = tuple(lora_modules)
        # SGLang's --schedule-low-priority-values-first (its default runs larger first).
        self.low_priority_first = low_priority_first
        # SGLang 0.5.23 serves /metrics only with --enable-metrics (off by default).
        self.metrics_enabled = metrics_enabled
        # GET /metrics answered so far: how tests and benchmarks count scrapes.
        self.metrics_requests = 0
        self.health_requests = 0  # GET /health answered so far (the gateway's probes)
        self.api_key = api_key
        self.profile = profile
        self.model_name = model_name
        self.flavor = flavor
        self.seed = seed
        self.role = Role(role)
        self.priority_scheduling = priority_scheduling
        self.engine_id = f"kvgate-sim-{index}-{uuid.uuid4().hex[:8]}"
        self.model = EngineModel(
            profile,
            priority_scheduling=priority_scheduling,
            higher_priority_first=flavor == "sglang" and not low_priority_first,
            seed=seed,
            tokenizer=tokenizer,
        )
        self.metrics = SimMetrics(self.model, model_name, flavor)
        self.model.on_finished = self.metrics.observe_finished
        self.runner = EngineRunner(self.model, RealClock(time_scale))
        self.kv_events = kv_events
        self.kv_publisher: KVEventPublisher | None = None
        self.faults = FaultState(faults, seed=seed + index)
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.request_log: deque[RequestRecord] = deque(maxlen=request_log_size)
        # Responses kept for `previous_response_id` and `GET /v1/responses/{id}`.
        self.responses = ResponseStore(DEFAULT_REQUEST_LOG_SIZE)
        # (sha256, size) of each audio file received, for the pass-through tests, and the
        # upload bytes received so far (counted as they arrive, before a form is complete).
        self.uploads: deque[tuple[str, int]] = deque(maxlen=request_log_size)
        # /v1/audio/speech: (sha256, size) of each body sent whole, bytes sent so far, and
        # an event that, while set here and not yet set itself, holds back each last part.
        self.speeches: deque[tuple[str, int]] = deque(maxlen=request_log_size)
        self.speech_bytes_sent = 0
        self.speech_hold: asyncio.Event | None = None
        # (method, path) of each stored-response request (retrieve, cancel), for routing tests.
        self.lifecycle_log: deque[tuple[str, str]] = deque(maxlen=request_log_size)
        self.upload_bytes = 0
        # W3C trace context of each generation request as received (X-Request-Id,
        # traceparent, tracestate), faulted ones included: vLLM continues that trace.
        self.trace_contexts: deque[tuple[str, str | None, str | None]] = deque(
            maxlen=request_log_size
        )
        # (method, path, headers) of every request received, for the credential tests: what
        # a client's headers look like once the gateway has forwarded them.
        self.received: deque[tuple[str, str, dict[str, str]]] = deque(maxlen=request_log_size)
        self.kv_pull_failures = 0
        self.rooms: dict[int, str] = {}
        # Mooncake: router-minted transfer id -> the prefill request holding its KV.
        self.transfers: dict[str, str] = {}
        self.closing = asyncio.Event()
        self.http: httpx.AsyncClient | None = None
        self.server: RunningServer | None = None
        self._refuse_task: asyncio.Task[None] | None = None
        self.app = self._build_app()

    # ---- what tests inspect ----------------------------------------------------------
    @property
    def aborted(self) -> int:
        """Requests aborted because the client disconnected."""
        return self.metrics.client_disconnects

    @property
    def blocks_in_use(self) -> int:
        return self.model.kv.blocks_in_use

    @property
    def url(self) -> str:
        if self.server is None:
            raise RuntimeError("engine not started")
        return self.server.url

    @property
    def host(self) -> str:
        return self.server.host if self.server else "127.0.0.1"

    @property
    def port(self) -> int:
        return self.server.port if self.server else 0

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = await start_server(self.app, host, port, timeout_keep_alive=self.keep_alive_s)
        if self.faults.config.refuse:
            await self.set_faults(self.faults.config, force=True)
        if self.kv_events is not None:
            self.start_kv_events(clear=False)

    # ---- KV cache events (vLLM's ZMQ publisher) --------------------------------------
    def start_kv_events(self, *, clear: bool = True) -> None:
        """Start publishing (again: a restarted engine numbers from 0 with an empty cache,
        so `clear` drops every cached block and publishes AllBlocksCleared first)."""
        options = self.kv_events or KVEventsOptions()
        old = self.kv_publisher
        publisher = KVEventPublisher(
            old.endpoint if old else f"tcp://{options.host}:*",
            (old.replay_endpoint if old else f"tcp://{options.host}:*") if options.replay else None,
            topic=options.topic,
            buffer_steps=options.buffer_steps,
            layout=options.layout,
        )
        publisher.start()
        self.kv_publisher = publisher
        self.model.kv.events = []
        if clear:
            self.model.kv.drop_cached()
        self.runner.on_deliver = self._flush_kv_events

    def stop_kv_events(self) -> None:
        """Kill the publisher (events of the meantime are lost, as with a dead process)."""
        self.runner.on_deliver = None
        self.model.kv.events = None
        if self.kv_publisher is not None:
            self.kv_publisher.stop()

    def _flush_kv_events(self) -> None:
        events = self.model.take_kv_events()
        if events and self.kv_publisher is not None:
            self.kv_publisher.publish(EventBatch(time.time(), tuple(events)))

    async def stop(self) -> None:
        self.stop_kv_events()
        if self._refuse_task is not None:
            self._refuse_task.cancel()
        # Release stalled responses first, or the server's graceful shutdown waits for them.
        self.closing.set()
        if self.server is not None:
            await self.server.stop()

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.closing.clear()
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(10.0), trust_env=False)
        await self.runner.start()
        try:
            yield
        finally:
            self.closing.set()
            await self.responses.close()
            await self.runner.stop()
            await self.http.aclose()
            self.http = None

    async def set_faults(self, config: FaultConfig, *, force: bool = False) -> None:
        """Apply a fault set; `refuse` closes/re-opens the listening socket."""
        old = self.faults.config
        self.faults.config = config
        server = self.server
        if server is None:
            return
        if config.refuse and (force or not old.refuse):
            server.pause_listening()
            if config.refuse_for is not None:
                self._refuse_task = asyncio.get_running_loop().create_task(
                    self._unrefuse_after(config.refuse_for)
                )
        elif not config.refuse and old.refuse:
            if self._refuse_task is not None:
                self._refuse_task.cancel()
                self._refuse_task = None
            await server.resume_listening()

    async def _unrefuse_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        self._refuse_task = None
        cleared = self.faults.config.model_copy(update={"refuse": False, "refuse_for": None})
        await self.set_faults(cleared)

    # ---- HTTP ------------------------------------------------------------------------
    def _build_app(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/embeddings", self._embeddings, methods=["POST"]),
            Route("/v1/responses", self._responses, methods=["POST"]),
            Route("/v1/responses/{response_id}", self._retrieve_response, methods=["GET"]),
            Route("/v1/responses/{response_id}/cancel", self._cancel_response, methods=["POST"]),
            Route("/v1/messages", self._messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self._count_tokens, methods=["POST"]),
            *(Route(path, self._extra, methods=["POST"]) for path in _EXTRA_PATHS),
            Route("/v1/audio/transcriptions", self._transcription, methods=["POST"]),
            Route("/v1/audio/translations", self._transcription, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self._model, methods=["GET"]),
            Route("/server_info", self._server_info, methods=["GET"]),
            Route("/kv_event_sources", self._kv_event_sources, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
            Route("/metrics/", self._metrics, methods=["GET"]),
            Route("/admin/faults", self._faults, methods=["GET", "POST"]),
            Route("/reset_prefix_cache", self._reset_prefix_cache, methods=["POST"]),
            Route("/sim/state", self._state, methods=["GET"]),
            Route("/sim/drop_cache", self._drop_cache, methods=["POST"]),
            Route("/sim/kv/{request_id}", self._kv_pull, methods=["GET"]),
            Route("/sim/bootstrap/{room:int}", self._bootstrap, methods=["GET"]),
        ]
        middleware = [Middleware(EchoRequestId), Middleware(RecordHeaders, log=self.received)]
        if self.api_key is not None:
            middleware.append(Middleware(RequireApiKey, key=self.api_key))
        return Starlette(routes=routes, lifespan=self._lifespan, middleware=middleware)

    async def _chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _completions(self, request: Request) -> Response:
        return await self._generate(request, "completions")

    async def _responses(self, request: Request) -> Response:
        return await self._generate(
            request, "responses", lambda body: responses_messages(body, self.responses.history)
        )

    async def _retrieve_response(self, request: Request) -> Response:
        self.lifecycle_log.append(("GET", request.url.path))
        if request.query_params.get("stream", "").lower() == "true":
            # vLLM replays a background stream's events from `starting_after`.
            return _error(400, "the simulated engine does not stream stored responses", "stream")
        try:
            return _json(self.responses.get(request.path_params["response_id"]), request)
        except WireError as exc:
            return _error(exc.status, exc.message, exc.param)

    async def _cancel_response(self, request: Request) -> Response:
        self.lifecycle_log.append(("POST", request.url.path))
        try:
            return _json(await self.responses.cancel(request.path_params["response_id"]), request)
        except WireError as exc:
            return _error(exc.status, exc.message, exc.param)

    async def _messages(self, request: Request) -> Response:
        return await self._generate(request, "messages", anthropic_messages)

    async def _count_tokens(self, request: Request) -> Response:
        """Anthropic's token count, as vLLM answers it: the prompt tokens the same body
        would have on /v1/messages (one template, so the counts agree)."""
        status = self.faults.should_error()
        if status is not None:
            return _anthropic_error(
                status, f"simulated fault: replica {self.index} answers {status}"
            )
        try:
            parsed = parse_generation(
                await request.body(), "messages", lambda b: anthropic_messages(b, budget=False)
            )
        except WireError as exc:
            return _anthropic_error(exc.status, exc.message, exc.param)
        if parsed.model is not None and parsed.model != self.model_name:
            return _anthropic_error(404, f"The model `{parsed.model}` does not exist.", "model")
        tokens, _ = self.model.prompt_from_text(parsed.text, parsed.cache_salt)
        self.request_log.append(RequestRecord(uuid.uuid4().hex, "count_tokens", 200, tokens))
        return _json({"input_tokens": tokens}, request)

    def store_response(
        self, response_id: str, parsed: ParsedRequest, text: str, answer: dict[str, Any]
    ) -> None:
        """Keep a Responses answer with its conversation, for `previous_response_id` and
        retrieval (vLLM keeps them in the memory of the process that made them)."""
        if parsed.echo is not None and parsed.echo.get("store", True) is False:
            return
        conversation = (*parsed.conversation, {"role": "assistant", "content": text})
        self.responses.put(response_id, conversation, answer)

    def _background(self, parsed: ParsedRequest, rid: str) -> Response:
        """`background: true`: a `queued` answer now, the generation in a task."""
        echo = parsed.echo or {}
        if echo.get("store", True) is False:
            return _error(400, "background can only be used when `store` is true", "background")
        if parsed.stream:
            return _error(
                400, "the simulated engine does not stream background responses", "stream"
            )
        generation = Generation(self, parsed, rid)
        queued = response_object(
            generation.api_id,
            self.model_name,
            echo,
            text=None,
            finish_reason=None,
            status="queued",
        )
        task = asyncio.create_task(generation.detached(), name=f"background-{rid}")
        self.responses.put(generation.api_id, (*parsed.conversation,), queued, task)
        return _json(queued)

    async def _extra(self, request: Request) -> Response:
        status = self.faults.should_error()
        if status is not None:
            return _error(status, f"simulated fault: replica {self.index} answers {status}")
        raw, path, model = await request.body(), request.url.path, self.model_name
        try:
            name = orjson.loads(raw).get("model") if raw else None
        except (orjson.JSONDecodeError, AttributeError):
            name = None
        if name is not None and name != model:
            return _error(404, f"The model `{name}` does not exist.", "model")
        try:
            if path == "/v1/audio/speech":
                return SpeechResponse(self, raw)
            body: Any
            if path == "/tokenize":
                max_len = min(self.profile.max_model_len, self.profile.kv_capacity_tokens)
                body = extras.tokenize(raw, self.model.tokenizer.ids, max_len)
            elif path == "/detokenize":
                body = extras.detokenize(raw)
            elif path in ("/v1/rerank", "/rerank", "/v2/rerank"):
                body = extras.rerank(raw, model)
            elif path in ("/v1/score", "/score"):
                body = extras.score(raw, model)
            elif path in ("/v1/classify", "/classify"):
                body = extras.classify(raw, model)
            else:
                body = extras.pooling(raw, model)
        except WireError as exc:
            return _error(exc.status, exc.message, exc.param)
        self.request_log.append(RequestRecord(uuid.uuid4().hex, path, 200))
        return _json(body, request)

    async def _transcription(self, request: Request) -> Response:
        chunks = []
        try:
            async for chunk in request.stream():
                self.upload_bytes += len(chunk)
                chunks.append(chunk)
        except ClientDisconnect:
            self.metrics.client_disconnects += 1
            return Response(status_code=499)
        raw = b"".join(chunks)
        status = self.faults.should_error()
        if status is not None:
            return _error(status, f"simulated fault: replica {self.index} answers {status}")
        try:
            body, digest, size, stream = extras.transcription(
                raw, request.headers.get("content-type", ""), self.model_name
            )
        except WireError as exc:
            return _error(exc.status, exc.message, exc.param)
        self.uploads.append((digest, size))
        if stream:
            events = extras.transcription_stream(body, self.model_name)
            return Response(events, media_type="text/event-stream")
        return _json(body, request)

    async def _model(self, request: Request) -> Response:
        name = request.path_params["model_id"]
        if name != self.model_name:
            return _error(404, f"The model `{name}` does not exist.", "model")
        return _json(self._card(), request)

    async def _generate(
        self,
        request: Request,
        kind: Kind,
        to_chat: Callable[[Mapping[str, Any]], Sequence[Mapping[str, Any]]] | None = None,
    ) -> Response:
        error = _anthropic_error if kind == "messages" else _error
        if self.faults.config.slow:
            # Interruptible, so stopping the engine does not wait out the injected delay.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.closing.wait(), self.faults.config.slow)
            if self.closing.is_set():
                return _error(503, "engine is shutting down")
        headers = request.headers
        self.trace_contexts.append(
            (headers.get("x-request-id", ""), headers.get("traceparent"), headers.get("tracestate"))
        )
        status = self.faults.should_error()
        if status is not None:
            return error(status, f"simulated fault: replica {self.index} answers {status}")
        raw = await request.body()
        try:
            parsed = parse_generation(raw, kind, to_chat)
        except WireError as exc:
            return error(exc.status, exc.message, exc.param)
        if parsed.model is not None and not self._serves(parsed.model):
            return error(404, f"The model `{parsed.model}` does not exist.", "model")
        # SGLang ignores a priority it does not schedule by; vLLM refuses it.
        if parsed.priority != 0 and not self.priority_scheduling and self.flavor == "vllm":
            return error(
                400, f"Got priority {parsed.priority} but Priority scheduling is not enabled."
            )
        rid = request.headers.get("x-request-id") or parsed.body_request_id or uuid.uuid4().hex
        if kind == "responses" and parsed.echo is not None and parsed.echo.get("background"):
            return self._background(parsed, rid)
        return Generation(self, parsed, rid)

    async def _embeddings(self, request: Request) -> Response:
        status = self.faults.should_error()
        if status is not None:
            return _error(status, f"simulated fault: replica {self.index} answers {status}")
        raw = await request.body()
        try:
            body, _ = embeddings(raw, self.model_name, serves=self._serves)
        except WireError as exc:
            return _error(exc.status, exc.message, exc.param)
        return _json(body, request)

    async def _models(self, request: Request) -> Response:
        cards = [self._card()]
        for name in self.lora_modules:
            cards.append(
                {**self._card(), "id": name, "root": name, "parent": self.model_name}
                | {"max_model_len": None}
            )
        return _json({"object": "list", "data": cards}, request)

    def _serves(self, model: str) -> bool:
        return model == self.model_name or model in self.lora_modules

    def _card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "vllm",
            "root": self.model_name,
            "parent": None,
            "max_model_len": min(self.profile.max_model_len, self.profile.kv_capacity_tokens),
            "permission": [],
        }

    async def _server_info(self, request: Request) -> Response:
        """SGLang's server args (the few a diagnosis reads); vLLM has no such endpoint."""
        if self.flavor != "sglang":
            return _error(404, "Not Found")
        p = self.profile
        return _json(
            {
                "model_path": self.model_name,
                "context_length": min(p.max_model_len, p.kv_capacity_tokens),
                "max_running_requests": p.max_num_seqs,
                "chunked_prefill_size": p.max_num_batched_tokens,
                "max_total_num_tokens": p.kv_capacity_tokens,
                "page_size": p.block_size,
                "mem_fraction_static": p.gpu_memory_utilization,
                "enable_priority_scheduling": self.priority_scheduling,
                "schedule_low_priority_values_first": self.low_priority_first,
                "enable_metrics": self.metrics_enabled,
                "enable_cache_report": True,  # the simulator always reports cached tokens
                "kv_events": self._kv_events_descriptor(),
                "version": "sim",
            },
            request,
        )

    async def _health(self, request: Request) -> Response:
        self.health_requests += 1
        if self.faults.config.unhealthy or self.runner.error is not None:
            return Response(status_code=503)
        return Response(status_code=200)

    async def _metrics(self, request: Request) -> Response:
        self.metrics_requests += 1
        if not self.metrics_enabled:
            return _error(404, "Not Found")
        # A `name[]` selection is prometheus-client's ASGI app's: vLLM serves `/metrics`
        # itself (prometheus-fastapi-instrumentator's handler: the whole registry, the query
        # ignored) and mounts the app for the paths under it; SGLang mounts it for both.
        selecting = self.metrics.flavor == "sglang" or request.url.path.endswith("/")
        names = request.query_params.getlist("name[]") if selecting else []
        return Response(self.metrics.render(names or None), media_type=CONTENT_TYPE)

    def _publisher_config(self) -> dict[str, Any] | None:
        """The KV event publisher as vLLM 0.33 describes it (its `KVEventsConfig`)."""
        pub, options = self.kv_publisher, self.kv_events or KVEventsOptions()
        if pub is None:
            return None
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": pub.endpoint,
            "replay_endpoint": pub.replay_endpoint,
            "buffer_steps": options.buffer_steps,
            "hwm": 100_000,
            "max_queue_size": 100_000,
            "topic": options.topic,
        }

    async def _kv_event_sources(self, request: Request) -> Response:
        """vLLM 0.33's `GET /kv_event_sources`: the publisher config per DP rank."""
        if self.flavor != "vllm":
            return _error(404, "Not Found")
        config = self._publisher_config()
        return _json({} if config is None else {"0": config}, request)

    def _kv_events_descriptor(self) -> dict[str, Any] | None:
        """SGLang 0.5.23's `/server_info` `kv_events`: ports per DP rank from a base."""
        config = self._publisher_config()
        if config is None:
            return None
        host, port = config["endpoint"].removeprefix("tcp://").rsplit(":", 1)
        out: dict[str, Any] = {
            "publisher": "zmq",
            "endpoint_host": host,
            "endpoint_port_base": int(port),
            "topic": config["topic"],
            "block_size": self.profile.block_size,
            "dp_size": 1,
        }
        if config["replay_endpoint"]:
            out["replay_endpoint_port_base"] = int(config["replay_endpoint"].rsplit(":", 1)[1])
        return out

    async def _faults(self, request: Request) -> Response:
        if request.method == "POST":
            try:
                config = FaultConfig.model_validate_json(await request.body() or b"{}")
            except ValueError as exc:
                return _error(400, f"invalid fault set: {exc}")
            await self.set_faults(config)
        return _json(self.faults.config.model_dump(), request)

    async def _reset_prefix_cache(self, request: Request) -> Response:
        if not self.model.kv.reset_prefix_cache():
            return _error(400, "cannot reset the prefix cache while requests hold blocks")
        return Response(status_code=200)

    async def _drop_cache(self, request: Request) -> Response:
        # Unlike /reset_prefix_cache this does not refuse while requests hold blocks: a
        # benchmark can take a replica's cache away mid-replay, as a restart would.
        kv = self.model.kv
        dropped = kv.num_cached_blocks
        kv.drop_cached()
        return _json({"dropped_blocks": dropped})

    async def _state(self, request: Request) -> Response:
        m = self.model
        return _json(
            {
                "index": self.index,
                "role": self.role.value,
                "engine_id": self.engine_id,
                "profile": self.profile.name,
                "running": m.num_running,
                "waiting": m.num_waiting,
                "kv_usage": m.kv_usage,
                "blocks_in_use": m.kv.blocks_in_use,
                "num_gpu_blocks": m.kv.num_blocks,
                "cached_blocks": m.kv.num_cached_blocks,
                "held": m.num_held,
                "aborted": self.aborted,
                "faults": self.faults.config.model_dump(),
            },
            request,
        )

    async def _kv_pull(self, request: Request) -> Response:
        wanted = request.path_params["request_id"]
        released = self.runner.release_held(self.transfers.pop(wanted, wanted))
        if released is None:
            return _error(404, "no KV held for that request id")
        tokens, blocks = released
        return _json(self._kv_payload(tokens, blocks), request)

    async def _bootstrap(self, request: Request) -> Response:
        room: int = request.path_params["room"]
        rid = self.rooms.get(room)
        if rid is not None and self.model.is_held(rid):
            released = self.runner.release_held(rid)
            self.rooms.pop(room, None)
            if released is not None:
                return _json(self._kv_payload(*released), request)
        if rid is not None and self.model.get(rid) is None:
            self.rooms.pop(room, None)  # finished without holding (aborted / expired)
        return _error(404, f"bootstrap room {room} is not ready")

    def _kv_payload(self, tokens: int, blocks: tuple[int, ...]) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "tokens": tokens,
            "block_ids": list(blocks),
            "kv_bytes": tokens * self.profile.kv_bytes_per_token,
        }


def _json(body: Any, request: Request | None = None) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


_EXTRA_PATHS = (
    "/tokenize",
    "/detokenize",
    "/v1/rerank",
    "/rerank",
    "/v2/rerank",
    "/v1/score",
    "/score",
    "/v1/classify",
    "/classify",
    "/pooling",
    "/v1/audio/speech",
)


def _anthropic_error(status: int, message: str, param: str | None = None) -> Response:
    return Response(
        anthropic_error(status, message), status_code=status, media_type="application/json"
    )


def _error(status: int, message: str, param: str | None = None) -> Response:
    return Response(
        error_body(status, message, param), status_code=status, media_type="application/json"
    )
