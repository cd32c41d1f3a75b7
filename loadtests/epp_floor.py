"""The least an ext_proc endpoint picker can do on grpc.aio, to price the protocol itself.

It holds the request-headers answer until the body ended, names one fixed endpoint (the
destination header, its per-attempt copy and the `envoy.lb` metadata, as kvgate does),
re-streams the request body, names the replica on the response headers (as kvgate's
`x-kvgate-replica`) and echoes every response message: the same messages as `kvgate epp`
with no decision and no accounting. bench_epp.py (`--floor`) runs it behind
the same Envoy so that the EPP's CPU splits into the protocol's floor and kvgate's work.

    python loadtests/epp_floor.py --port 9002 --endpoint 127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse

from gateway.epp import wire


class Floor(external_processor_pb2_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, endpoint: str) -> None:
        self._answer = wire.destination_response(
            endpoint,
            [(wire.DESTINATION, endpoint.encode()), (f"{wire.DESTINATION}-0", endpoint.encode())],
            [],
        )
        self._served = wire.response_headers([("x-kvgate-replica", b"engine")])

    async def Process(
        self,
        requests: AsyncIterator[ProcessingRequest],
        context: grpc.aio.ServicerContext[ProcessingRequest, ProcessingResponse],
    ) -> AsyncIterator[ProcessingResponse]:
        body = bytearray()
        async for message in requests:
            kind = message.WhichOneof("request")
            if kind == "request_body":
                body += message.request_body.body
                if message.request_body.end_of_stream:
                    yield self._answer
                    for chunk in wire.request_body_chunks(bytes(body), 62_000):
                        yield chunk
            elif kind == "response_headers":
                yield self._served
            elif kind == "response_body":
                part = message.response_body
                yield wire.response_body(part.body, part.end_of_stream)
            elif kind == "response_trailers":
                yield wire.EMPTY_RESPONSE_TRAILERS
            elif kind == "request_trailers":
                yield wire.EMPTY_REQUEST_TRAILERS


async def serve(port: int, endpoint: str) -> None:
    server = grpc.aio.server()
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(Floor(endpoint), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--endpoint", required=True, help="ip:port every request goes to")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.port, args.endpoint))


if __name__ == "__main__":
    main()
