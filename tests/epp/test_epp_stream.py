"""The ext_proc stream protocol in-process: `EppService` on a real grpc.aio server, driven by a
gRPC client playing Envoy's part, in front of simulated engines on loopback.

The test forwards the body it was handed to the engine it was told (httpx, as Envoy's
ORIGINAL_DST cluster would) and hands the engine's answer back, so the request path, the
response path and the settle stage all run against real parts, in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, cast

import grpc
import httpx
import orjson
import pytest
import pytest_asyncio
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    HttpTrailers,
    ProcessingRequest,
    ProcessingResponse,
)
from google.protobuf.struct_pb2 import Struct
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from gateway.epp import wire
from gateway.epp.addresses import address_of
from gateway.epp.config import MAX_CHUNK_BYTES, EppSettings
from gateway.epp.exchange import EppStream
from gateway.epp.server import READY_POLL_S, EppService
from gateway.sim.server import SimEngine
from gateway.testing.process import free_port
from gateway.testing.servers import RunningGateway, gateway, sim_engines

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "kvgate-sim"
BODY_LIMIT = 300_000


@dataclass
class Rig:
    engines: list[SimEngine]
    gw: RunningGateway
    service: EppService
    channel: grpc.aio.Channel
    http: httpx.AsyncClient

    @property
    def stub(self) -> external_processor_pb2_grpc.ExternalProcessorStub:
        return external_processor_pb2_grpc.ExternalProcessorStub(self.channel)

    def replica_of(self, address: str) -> SimEngine:
        return next(e for e in self.engines if address_of(e.url) == address)

    def sample(self, name: str, **labels: str) -> float:
        text = self.gw.state.metrics.render().decode()
        total = 0.0
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total


@contextlib.asynccontextmanager
async def epp_service(gw: RunningGateway, **settings: Any) -> AsyncIterator[EppService]:
    service = EppService(
        gw.state, EppSettings(host="127.0.0.1", port=free_port(), grace_s=0, **settings)
    )
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig() -> AsyncIterator[Rig]:
    async with (
        sim_engines(2) as engines,
        gateway(
            engines,
            health={"interval_s": 30},
            limits={"max_body_bytes": BODY_LIMIT},
        ) as gw,
        epp_service(gw) as service,
        grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as channel,
        httpx.AsyncClient(timeout=10) as http,
    ):
        yield Rig(engines, gw, service, channel, http)


# ---- building Envoy's messages ------------------------------------------------------------


def header_map(pairs: list[tuple[str, str]]) -> HeaderMap:
    out = HeaderMap()
    for name, value in pairs:
        out.headers.append(HeaderValue(key=name, raw_value=value.encode()))
    return out


def request_headers(
    path: str,
    *,
    method: str = "POST",
    end: bool = False,
    extra: list[tuple[str, str]] = (),  # type: ignore[assignment]
    subset: object = None,
) -> ProcessingRequest:
    pairs = [(":method", method), (":path", path), (":authority", "gw"), *extra]
    if method == "POST":
        pairs.append(("content-type", "application/json"))
    out = ProcessingRequest(
        request_headers=HttpHeaders(headers=header_map(pairs), end_of_stream=end)
    )
    if subset is not None:
        hint = Struct()
        hint.update({wire.SUBSET: subset})
        out.metadata_context.filter_metadata[wire.SUBSET_NAMESPACE].CopyFrom(hint)
    return out


def request_body(chunk: bytes, end: bool) -> ProcessingRequest:
    return ProcessingRequest(request_body=HttpBody(body=chunk, end_of_stream=end))


def response_headers(
    status: int, content_type: str, *, served: str | None = None, end: bool = False
) -> ProcessingRequest:
    pairs = [(":status", str(status)), ("content-type", content_type)]
    out = ProcessingRequest(
        response_headers=HttpHeaders(headers=header_map(pairs), end_of_stream=end)
    )
    if served is not None:
        lb = Struct()
        lb.update({wire.SERVED: served})
        out.metadata_context.filter_metadata[wire.LB_NAMESPACE].CopyFrom(lb)
    return out


def response_body(chunk: bytes, end: bool) -> ProcessingRequest:
    return ProcessingRequest(response_body=HttpBody(body=chunk, end_of_stream=end))


def chat(content: str, **extra: Any) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}
    return orjson.dumps(body)


# ---- reading the EPP's answers --------------------------------------------------------------


def set_headers(mutation: Any) -> dict[str, bytes]:
    return {h.header.key: h.header.raw_value for h in mutation.set_headers}


def destination(answer: ProcessingResponse) -> list[str]:
    assert answer.WhichOneof("response") == "request_headers", answer
    common = answer.request_headers.response
    header = set_headers(common.header_mutation)[wire.DESTINATION].decode()
    meta = answer.dynamic_metadata.fields[wire.LB_NAMESPACE].struct_value
    assert meta.fields[wire.DESTINATION].string_value == header
    assert common.clear_route_cache
    return header.split(",")


async def read_body(call: Any) -> tuple[bytes, list[int]]:
    """The re-streamed request body and its chunk sizes, up to the chunk that ends it."""
    parts: list[bytes] = []
    while True:
        answer = await call.read()
        streamed = answer.request_body.response.body_mutation.streamed_response
        parts.append(streamed.body)
        if streamed.end_of_stream:
            return b"".join(parts), [len(p) for p in parts]


async def immediate(rig: Rig, messages: list[ProcessingRequest]) -> Any:
    call = rig.stub.Process()
    for message in messages:
        await call.write(message)
    answer = await call.read()
    await call.done_writing()
    assert answer.WhichOneof("response") == "immediate_response", answer
    assert await call.read() == grpc.aio.EOF  # an immediate answer ends the stream
    return answer.immediate_response


async def settled(rig: Rig, before: float) -> None:
    """Until a request beyond `before` was counted and nothing is in flight."""
    for _ in range(300):
        if rig.sample("kvgate_requests_total") > before and rig.sample("kvgate_in_flight") == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the request was not settled")


# ---- the tests ------------------------------------------------------------------------------


async def test_health_services_follow_the_replicas(rig: Rig) -> None:
    health = health_pb2_grpc.HealthStub(rig.channel)

    async def status(service: str) -> int:
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
        return int(reply.status)

    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        (health_pb2.HealthCheckResponse.NOT_SERVING),
    )

    async def becomes(want: int) -> None:
        for _ in range(int(READY_POLL_S * 4 / 0.02)):
            if await status("readiness") == want:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"readiness never became {want}")

    await becomes(serving)
    for name in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor", ""):
        assert await status(name) == serving, name
    cluster = rig.gw.state.cluster
    try:
        for rid in cluster.members:
            cluster.set_healthy(rid, False)
        await becomes(not_serving)
        assert await status("") == not_serving
        assert await status("liveness") == serving  # the process still runs
        # No healthy replica: a routed request is refused by the EPP itself.
        refused = await immediate(
            rig,
            [
                request_headers("/v1/chat/completions"),
                request_body(chat("hello", max_tokens=2), True),
            ],
        )
        assert refused.status.code == 503
        assert set_headers(refused.headers)[wire.DROPPED_REASON] == b"rejected-no-endpoints"
    finally:
        for rid in cluster.members:
            cluster.set_healthy(rid, True)
    await becomes(serving)


async def test_a_chat_request_round_trip_through_the_stream(rig: Rig) -> None:
    before = rig.sample("kvgate_requests_total", status="200")
    decisions = rig.sample("kvgate_epp_decision_seconds_count")
    body = chat("tell me about the sea " * 20, max_tokens=5)
    call = rig.stub.Process()
    await call.write(request_headers("/v1/chat/completions", extra=[("x-request-id", "epp-1")]))
    # Envoy streams the body in pieces; the answer waits for its end.
    await call.write(request_body(body[:100], False))
    await call.write(request_body(body[100:], True))
    answer = await call.read()
    ranked = destination(answer)
    assert sorted(ranked) == sorted(address_of(e.url) for e in rig.engines)
    per_attempt = set_headers(answer.request_headers.response.header_mutation)
    assert [per_attempt[f"{wire.DESTINATION}-{i}"].decode() for i in range(2)] == ranked
    forwarded, sizes = await read_body(call)
    assert orjson.loads(forwarded) == orjson.loads(body)
    assert len(sizes) == 1
    # Envoy's part: send the body to the primary, hand the answer back.
    engine = rig.replica_of(ranked[0])
    reply = await rig.http.post(
        engine.url + "/v1/chat/completions",
        content=forwarded,
        headers={"content-type": "application/json", "x-request-id": "epp-1"},
    )
    assert reply.status_code == 200
    assert engine.request_log[-1].request_id == "epp-1"
    await call.write(response_headers(200, "application/json"))
    headers_answer = await call.read()
    replica = set_headers(headers_answer.response_headers.response.header_mutation)
    assert replica["x-kvgate-replica"] == f"e{engine.index}".encode()
    half = len(reply.content) // 2
    await call.write(response_body(reply.content[:half], False))
    await call.write(response_body(reply.content[half:], True))
    echoed = [await call.read(), await call.read()]
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    chunks = [a.response_body.response.body_mutation.streamed_response for a in echoed]
    assert b"".join(c.body for c in chunks) == reply.content
    assert [c.end_of_stream for c in chunks] == [False, True]
    await settled(rig, before)
    assert rig.sample("kvgate_requests_total", status="200") == before + 1
    assert rig.sample("kvgate_epp_decision_seconds_count") == decisions + 1
    assert rig.sample("kvgate_in_flight") == 0


async def test_a_streamed_answer_is_relayed_and_its_usage_stripped(rig: Rig) -> None:
    before = rig.sample("kvgate_requests_total", status="200")
    tokens = rig.sample("kvgate_generation_tokens_total")
    call = rig.stub.Process()
    await call.write(request_headers("/v1/chat/completions"))
    await call.write(request_body(chat("stream me", max_tokens=4, stream=True), True))
    ranked = destination(await call.read())
    forwarded, _ = await read_body(call)
    sent = orjson.loads(forwarded)
    # kvgate asks the engine for usage on the client's behalf, and takes it out again.
    assert sent["stream_options"] == {"include_usage": True}
    engine = rig.replica_of(ranked[0])
    async with rig.http.stream(
        "POST", engine.url + "/v1/chat/completions", content=forwarded
    ) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        await call.write(response_headers(200, reply.headers["content-type"]))
        await call.read()
        relayed = bytearray()
        async for piece in reply.aiter_raw():
            await call.write(response_body(piece, False))
            answer = await call.read()
            relayed += answer.response_body.response.body_mutation.streamed_response.body
    await call.write(response_body(b"", True))
    last = await call.read()
    relayed += last.response_body.response.body_mutation.streamed_response.body
    await call.done_writing()
    assert last.response_body.response.body_mutation.streamed_response.end_of_stream
    events = [line for line in bytes(relayed).split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    assert not any(b'"usage":{' in e for e in events)  # the client did not ask for it
    await settled(rig, before)
    assert rig.sample("kvgate_generation_tokens_total") == tokens + 4


async def test_a_stream_reset_after_its_last_chunk_is_settled_as_served(rig: Rig) -> None:
    """Envoy may reset the ext_proc stream as soon as it holds the last body chunk, before the
    EPP's loop resumes: the request still counts as served, with the usage it reported."""
    before = rig.sample("kvgate_requests_total", status="200")
    tokens = rig.sample("kvgate_generation_tokens_total")
    left = rig.sample("kvgate_client_disconnects_total")
    inbox: asyncio.Queue[ProcessingRequest] = asyncio.Queue()

    async def from_envoy() -> AsyncIterator[ProcessingRequest]:
        while True:
            yield await inbox.get()

    stream = EppStream(rig.service.core)
    answers = cast(AsyncGenerator[ProcessingResponse, None], stream.run(from_envoy()))
    await inbox.put(request_headers("/v1/chat/completions"))
    await inbox.put(request_body(chat("stream me once", max_tokens=3, stream=True), True))
    ranked = destination(await anext(answers))
    body = b""
    while not (
        part := (await anext(answers)).request_body.response.body_mutation
    ).streamed_response.end_of_stream:
        body += part.streamed_response.body
    body += part.streamed_response.body
    engine = rig.replica_of(ranked[0])
    reply = await rig.http.post(engine.url + "/v1/chat/completions", content=body)
    await inbox.put(response_headers(200, "text/event-stream"))
    await anext(answers)
    await inbox.put(response_body(reply.content, True))
    last = await anext(answers)
    assert last.response_body.response.body_mutation.streamed_response.end_of_stream
    # The reset: the generator is closed at the yield that handed the last chunk back.
    await answers.aclose()
    await stream.close()
    assert rig.sample("kvgate_requests_total", status="200") == before + 1
    assert rig.sample("kvgate_generation_tokens_total") == tokens + 3
    assert rig.sample("kvgate_client_disconnects_total") == left
    assert rig.sample("kvgate_in_flight") == 0


async def test_a_large_body_is_re_chunked_at_62000_bytes(rig: Rig) -> None:
    body = chat("word " * 40_000, max_tokens=1)  # ~200 KB of JSON, under the body limit
    assert 3 * MAX_CHUNK_BYTES < len(body) < BODY_LIMIT
    call = rig.stub.Process()
    await call.write(request_headers("/v1/chat/completions"))
    for start in range(0, len(body), 16_384):  # Envoy's own buffer-sized pieces
        await call.write(request_body(body[start : start + 16_384], start + 16_384 >= len(body)))
    ranked = destination(await call.read())
    forwarded, sizes = await read_body(call)
    assert orjson.loads(forwarded) == orjson.loads(body)
    assert max(sizes) == MAX_CHUNK_BYTES and all(s <= MAX_CHUNK_BYTES for s in sizes)
    assert len(sizes) == -(-len(forwarded) // MAX_CHUNK_BYTES)
    before = rig.sample("kvgate_requests_total")
    left = rig.sample("kvgate_client_disconnects_total")
    call.cancel()  # the client left before an answer: settled as a disconnect
    await settled(rig, before)
    assert rig.sample("kvgate_client_disconnects_total") == left + 1
    assert len(ranked) == 2


async def test_a_client_that_leaves_is_settled_as_a_disconnect(rig: Rig) -> None:
    before = rig.sample("kvgate_client_disconnects_total")
    requests = rig.sample("kvgate_requests_total")
    call = rig.stub.Process()
    await call.write(request_headers("/v1/chat/completions"))
    await call.write(request_body(chat("leaving", max_tokens=50, stream=True), True))
    destination(await call.read())
    await read_body(call)
    assert rig.sample("kvgate_in_flight") == 1
    await call.write(response_headers(200, "text/event-stream"))
    await call.read()
    await call.write(response_body(b'data: {"choices":[]}\n\n', False))
    await call.read()
    call.cancel()
    await settled(rig, requests)
    assert rig.sample("kvgate_client_disconnects_total") == before + 1


async def test_envoy_failover_moves_the_slot_to_the_replica_that_served(rig: Rig) -> None:
    failovers = rig.sample("kvgate_retries_total", reason="envoy_failover")
    before = rig.sample("kvgate_requests_total")
    call = rig.stub.Process()
    await call.write(request_headers("/v1/chat/completions"))
    await call.write(request_body(chat("fail over", max_tokens=2), True))
    ranked = destination(await call.read())
    await read_body(call)
    second = rig.replica_of(ranked[1])
    await call.write(response_headers(200, "application/json", served=ranked[1]))
    answer = await call.read()
    named = set_headers(answer.response_headers.response.header_mutation)["x-kvgate-replica"]
    assert named == f"e{second.index}".encode()
    # A body-less answer ends with its headers: the request is settled there.
    await call.write(response_headers(200, "application/json", end=True))
    await call.read()
    await call.done_writing()
    await settled(rig, before)
    assert rig.sample("kvgate_retries_total", reason="envoy_failover") == failovers + 1
    assert rig.sample("kvgate_in_flight") == 0


async def test_routes_no_policy_decides_go_to_any_healthy_replica_in_turn(rig: Rig) -> None:
    seen: list[str] = []
    for _ in range(2):
        call = rig.stub.Process()
        await call.write(request_headers("/v1/models", method="GET", end=True))
        ranked = destination(await call.read())
        assert len(ranked) == 2
        end = await call.read()
        assert end.request_body.response.body_mutation.streamed_response.end_of_stream
        call.cancel()
        seen.append(ranked[0])
    assert seen[0] != seen[1]  # rotated per call
    only = address_of(rig.engines[1].url)
    call = rig.stub.Process()
    await call.write(request_headers("/v1/models", method="GET", end=True, subset=[only]))
    assert destination(await call.read()) == [only]
    call.cancel()
    refused = await immediate(
        rig, [request_headers("/health", method="GET", end=True, subset="10.255.0.1:9")]
    )
    assert refused.status.code == 503


async def test_the_subset_hint_narrows_the_ranking(rig: Rig) -> None:
    only = address_of(rig.engines[0].url)
    call = rig.stub.Process()
    await call.write(request_headers("/v1/completions", subset=f" {only} , "))
    await call.write(request_body(orjson.dumps({"model": MODEL, "prompt": "x"}), True))
    assert destination(await call.read()) == [only]
    call.cancel()
    refused = await immediate(
        rig,
        [
            request_headers("/v1/completions", subset=["10.255.0.1:9"]),
            request_body(orjson.dumps({"model": MODEL, "prompt": "x"}), True),
        ],
    )
    assert refused.status.code == 503
    assert b"subset hint" in refused.body
    assert orjson.loads(refused.body)["error"]["code"] == "no_healthy_replica"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (chat("hi").replace(MODEL.encode(), b"nope"), 404, "model_not_found"),
        (b"{not json", 400, None),
        (b"x" * (BODY_LIMIT + 1), 413, None),
    ],
)
async def test_bad_requests_are_answered_by_the_epp(
    rig: Rig, body: bytes, status: int, code: str | None
) -> None:
    errors = rig.sample("kvgate_errors_total")
    messages = [request_headers("/v1/chat/completions")]
    messages += [request_body(body[:BODY_LIMIT], False), request_body(body[BODY_LIMIT:], True)]
    refused = await immediate(rig, messages)
    assert refused.status.code == status
    assert set_headers(refused.headers)["content-type"].startswith(b"application/json")
    error = orjson.loads(refused.body)["error"]
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    assert rig.sample("kvgate_errors_total") == errors + 1
    assert rig.sample("kvgate_in_flight") == 0


async def test_request_trailers_end_the_body_and_are_answered(rig: Rig) -> None:
    call = rig.stub.Process()
    await call.write(request_headers("/v1/completions"))
    body = orjson.dumps({"model": MODEL, "prompt": "trailing", "max_tokens": 1})
    await call.write(request_body(body, False))
    await call.write(ProcessingRequest(request_trailers=HttpTrailers()))
    destination(await call.read())
    streamed = (await call.read()).request_body.response.body_mutation.streamed_response
    assert orjson.loads(streamed.body)["prompt"] == "trailing"
    assert not streamed.end_of_stream  # the trailers end the request, not the body
    await call.write(response_headers(200, "application/json"))
    await call.read()
    await call.write(response_body(b'{"usage":{"prompt_tokens":1}}', False))
    await call.read()
    await call.write(ProcessingRequest(response_trailers=HttpTrailers()))
    trailers = await call.read()
    assert trailers.WhichOneof("response") == "response_trailers"
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF


async def test_a_stream_that_does_not_open_with_headers_gets_no_answer(rig: Rig) -> None:
    call = rig.stub.Process()
    await call.write(request_body(b"{}", True))
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    # Envoy closing the stream mid-body: nothing decided, nothing held.
    call = rig.stub.Process()
    await call.write(request_headers("/v1/completions"))
    await call.write(request_body(b'{"model":', False))
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert rig.sample("kvgate_in_flight") == 0


async def test_a_body_that_does_not_arrive_in_time_is_408(rig: Rig) -> None:
    core = rig.service.core
    kept = core.settings
    core.settings = kept.model_copy(update={"body_timeout_s": 0.2})
    try:
        call = rig.stub.Process()
        await call.write(request_headers("/v1/completions"))
        await call.write(request_body(b'{"model":', False))
        answer = await call.read()
        call.cancel()
    finally:
        core.settings = kept
    assert answer.immediate_response.status.code == 408
    assert orjson.loads(answer.immediate_response.body)["error"]["code"] == "request_body_timeout"


async def test_a_saturated_cluster_is_refused_with_429() -> None:
    admission = {
        "enabled": True,
        "saturation": {"max_inflight": 1, "max_waiting": None, "max_kv_usage": None},
        "max_wait_s": 0.1,
    }
    async with (
        sim_engines(1) as engines,
        gateway(engines, admission=admission, health={"interval_s": 30}) as gw,
        epp_service(gw) as service,
        grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as channel,
    ):
        stub = external_processor_pb2_grpc.ExternalProcessorStub(channel)
        held = stub.Process()
        await held.write(request_headers("/v1/chat/completions"))
        await held.write(request_body(chat("first", max_tokens=2), True))
        destination(await held.read())
        shed = stub.Process()
        await shed.write(request_headers("/v1/chat/completions"))
        await shed.write(request_body(chat("second", max_tokens=2), True))
        answer = (await shed.read()).immediate_response
        held.cancel()
        shed.cancel()
    assert answer.status.code == 429
    assert set_headers(answer.headers)[wire.DROPPED_REASON] == b"rejected-saturated"
    assert answer.details == "rejected-saturated"
