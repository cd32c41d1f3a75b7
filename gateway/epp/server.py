"""The ext_proc gRPC server on `grpc.aio`, its health services, and the `Service` it runs as.

`EppService` is appended to the app's services by `kvgate epp`, so it starts after every
feature (store, discovery, scraper) and stops before them. Health (grpc.health.v1):
`liveness` serves while the process runs; `readiness`, the ext_proc service name and the
overall status ("") serve once a healthy replica is known and the store is not degraded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import Histogram

from gateway.epp import wire
from gateway.epp.addresses import AddressBook
from gateway.epp.config import EppSettings
from gateway.epp.exchange import EppStream
from gateway.proxy import ProxyEndpoint
from gateway.proxy.inbound import Inbound
from gateway.proxy.outcome import Outcome
from gateway.request_id import RequestIds
from gateway.state import GatewayState
from gateway.store.base import Store
from gateway.types import ENDPOINT_PATHS, EXTRA_PATHS, Endpoint, ReplicaId

log = logging.getLogger("kvgate.epp")

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
READY_SERVICES = ("readiness", SERVICE_NAME, "")
READY_POLL_S = 0.5
_MAX_ID = 128


class EppCore:
    """What every stream shares: the state, one set of proxy stages per route, addresses."""

    def __init__(self, state: GatewayState, settings: EppSettings) -> None:
        self.state = state
        self.settings = settings
        paths: dict[str, Endpoint] = {p: e for e, p in ENDPOINT_PATHS.items()}
        paths.update(EXTRA_PATHS)
        self.routes: dict[str, tuple[ProxyEndpoint, Inbound, Outcome]] = {
            path: (ProxyEndpoint(state, e, path), Inbound(state, e, path), Outcome(state, e))
            for path, e in paths.items()
        }
        self.book = AddressBook()
        self.replica_header = "x-kvgate-replica"
        self._new_id = RequestIds()
        self._rotate = 0
        self.decision_seconds = Histogram(
            "kvgate_epp_decision_seconds",
            "From the request body's end to the destination answer (parse, identity, choice)",
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1, 0.5, 2.5),
            registry=state.metrics.registry,
        )

    def request_id(self, headers: list[tuple[bytes, bytes]]) -> str:
        """The client's X-Request-Id (Envoy's, else) when 1-128 ASCII bytes, else a new one."""
        for name, value in headers:
            if name == b"x-request-id":
                if 0 < len(value) <= _MAX_ID and value.isascii():
                    return value.decode("ascii")
                break
        return self._new_id()

    def destination(
        self,
        ranked: tuple[ReplicaId, ...],
        client: list[tuple[bytes, bytes]],
        forwarded: list[tuple[bytes, bytes]],
        length: int | None,
    ) -> ProcessingResponse:
        members = self.state.cluster.members
        addresses = [self.book.address(members, r) for r in ranked]
        value = ",".join(addresses)
        set_headers: list[tuple[str, bytes]] = [(wire.DESTINATION, value.encode())]
        if self.settings.per_attempt_headers:
            set_headers += [
                (f"{wire.DESTINATION}-{i}", a.encode()) for i, a in enumerate(addresses)
            ]
        remove: list[str] = []
        if length is not None:
            set_headers.append(("content-length", b"%d" % length))
        for name in (b"authorization", b"traceparent"):
            # The proxy's inbound stage may replace them for the engine (its own key, a
            # child span): Envoy forwards the client's unless told.
            old = next((v for n, v in client if n == name), None)
            new = next((v for n, v in forwarded if n == name), None)
            if new != old and forwarded:
                if new is None:
                    remove.append(name.decode())
                else:
                    set_headers.append((name.decode(), new))
        return wire.destination_response(value, set_headers, remove)

    def any_replicas(self, subset: list[str] | None) -> tuple[ReplicaId, ...]:
        """Healthy members, rotated per call, for routes no policy decides (GET /v1/models)."""
        cluster = self.state.cluster
        members = cluster.members
        healthy = [r for r in members if cluster.is_healthy(r)]
        if subset is not None:
            allowed = set(subset)
            healthy = [r for r in healthy if self.book.address(members, r) in allowed]
        if not healthy:
            return ()
        self._rotate = (self._rotate + 1) % len(healthy)
        turned = healthy[self._rotate :] + healthy[: self._rotate]
        return tuple(turned[: self.settings.max_endpoints])

    def ready(self) -> bool:
        cluster = self.state.cluster
        if not any(cluster.is_healthy(r) for r in cluster.members):
            return False
        store: Store | None = self.state.extras.get("store")
        return not (store is not None and store.status().degraded)


class ExternalProcessor(external_processor_pb2_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, core: EppCore) -> None:
        self._core = core

    async def Process(
        self,
        request_iterator: AsyncIterator[ProcessingRequest],
        context: grpc.aio.ServicerContext[ProcessingRequest, ProcessingResponse],
    ) -> AsyncIterator[ProcessingResponse]:
        stream = EppStream(self._core)
        try:
            async for response in stream.run(request_iterator):
                yield response
        except asyncio.CancelledError:
            raise  # the stream was reset (the client left): close() settles it
        except Exception:
            # The outermost boundary of a stream: log, and let Envoy apply its failure mode.
            log.exception("ext_proc stream failed")
            raise
        finally:
            await stream.close()


class EppService:
    """The gRPC server as an app `Service` (started in the app's lifespan)."""

    def __init__(self, state: GatewayState, settings: EppSettings) -> None:
        self.core = EppCore(state, settings)
        self.settings = settings
        self.health = health_aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.core.state.dispatcher is not None:
            log.warning("PD hand-off is not available through the EPP: Envoy sends one leg")
        server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", 8 * 1024 * 1024)],
        )
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(
            ExternalProcessor(self.core), server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        await self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        for name in READY_SERVICES:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = server.add_insecure_port(f"{self.settings.host}:{self.settings.port}")
        await server.start()
        self.server = server
        self._watch = asyncio.create_task(self._readiness(), name="kvgate-epp-readiness")
        log.warning("kvgate epp: ext_proc on %s:%d", self.settings.host, self.port)

    async def _readiness(self) -> None:
        ready: bool | None = None
        while True:
            now = self.core.ready()
            if now != ready:
                ready = now
                status = (
                    health_pb2.HealthCheckResponse.SERVING
                    if now
                    else health_pb2.HealthCheckResponse.NOT_SERVING
                )
                for name in READY_SERVICES:
                    await self.health.set(name, status)
            await asyncio.sleep(READY_POLL_S)

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self.server is not None:
            await self.health.enter_graceful_shutdown()
            await self.server.stop(self.settings.grace_s)
            self.server = None
