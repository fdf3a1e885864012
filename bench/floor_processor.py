"""The floor of the stack: a grpc.aio ext_proc server that does the least a picker can do
(FULL_DUPLEX: hold headers, echo the body, answer response headers, always the same fixed
destination) on the same message classes. bench_proxy.py runs it beside extproc so extproc's
cost is reported as a ratio to what the transport alone costs on this machine.

    python bench/floor_processor.py PORT DESTINATION
"""

from __future__ import annotations

import sys

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc import protocol
from extproc.core import Decision, Endpoint
from extproc.server import wire


async def serve(port: int, destination: str) -> None:
    routed = wire.routed_headers(Decision(endpoints=(Endpoint(destination),)))
    resp_headers = wire.CONTINUE_RESPONSE_HEADERS

    async def process(requests, context):
        chunks: list[bytes] = []
        async for msg in requests:
            kind = msg.WhichOneof("request")
            if kind == "request_body":
                chunks.append(msg.request_body.body)
                if msg.request_body.end_of_stream:
                    yield routed
                    for r in wire.streamed_body(b"".join(chunks), end_of_stream=True):
                        yield r
            elif kind == "response_headers":
                yield resp_headers

    handler = grpc.stream_stream_rpc_method_handler(
        process,
        request_deserializer=wire.ProcessingRequest.FromString,
        response_serializer=wire.ProcessingResponse.SerializeToString,
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(protocol.EXT_PROC_SERVICE, {"Process": handler}),)
    )
    # Envoy health-checks the picker cluster, so the floor answers health too.
    healthy = health.aio.HealthServicer()
    await healthy.set("readiness", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(healthy, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    uvloop.run(serve(int(sys.argv[1]), sys.argv[2]))
