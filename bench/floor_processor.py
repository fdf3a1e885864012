"""The floor of the stack: a grpc.aio ext_proc server that does the least a picker can do on the
same message classes and the same transport (TLS by default, as the picker's port; the
access-log stream accepted and drained), always answering one fixed destination.
bench_proxy.py runs it beside extproc so extproc's cost is a ratio to what the transport alone
costs on this machine, in the same exchange:

- FULL_DUPLEX_STREAMED (gateways, and the picker's default): hold the header reply until the
  body ended, then the decision on the headers and the body echoed; response headers answered.
- BUFFERED: headers CONTINUE, the decision on the body reply (no echo); response headers
  answered.
- Behind a gateway's settings (FULL_DUPLEX_STREAMED response bodies too): response body chunks
  echoed, trailers answered.

    python bench/floor_processor.py PORT DESTINATION [--plaintext] [--max-streams=N]
        [--transport=aio|sync|grpclib] [--loop=uvloop|asyncio] [--option=NAME=INT ...]
        [--threads=N] [--envoy-concurrency=N] [--app=picker_pyvoy:app]

`--transport` other than aio runs the same loop on another server (`floor_transports.py`);
`--loop` picks the event loop of the asyncio ones; `--option` adds a grpcio server option
(an integer where it parses as one, e.g. `grpc.so_reuseport=0`). The C core's environment knobs
(`GRPC_POLL_STRATEGY`, `GRPC_ENABLE_FORK_SUPPORT`) are set by whoever starts the process.
"""

from __future__ import annotations

import asyncio
import sys

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc import protocol
from extproc._proto.extproc.wire.v1 import access_log_pb2
from extproc.core import Decision, Endpoint
from extproc.server import wire
from extproc.server.access_log import SERVICE as ACCESS_LOG_SERVICE
from extproc.server.tls import self_signed, server_credentials

_FULL_DUPLEX = wire.BodySendMode.FULL_DUPLEX_STREAMED


async def serve(
    port: int,
    destination: str,
    *,
    tls: bool = True,
    max_streams: int = 0,
    options: tuple[tuple[str, int | str], ...] = (),
) -> None:
    decision = Decision(endpoints=(Endpoint(destination),))
    on_headers = wire.routed_headers(decision)
    on_body = wire.routed_body(decision)
    resp_headers = wire.CONTINUE_RESPONSE_HEADERS
    cont_headers = wire.CONTINUE_REQUEST_HEADERS

    async def process(requests, context):
        chunks: list[bytes] | None = []
        duplex = True
        async for msg in requests:
            kind = msg.WhichOneof("request")
            if kind == "request_headers":
                duplex = msg.protocol_config.request_body_mode == _FULL_DUPLEX
                if not duplex:
                    yield cont_headers
            elif kind == "request_body":
                if not duplex:
                    yield on_body
                    continue
                chunks.append(msg.request_body.body)
                if msg.request_body.end_of_stream:
                    yield on_headers
                    for r in wire.streamed_body(b"".join(chunks), end_of_stream=True):
                        yield r
                    chunks = None
            elif kind == "request_trailers":
                if duplex and chunks is not None:
                    # Trailers end the body: the decision, the body, then their reply.
                    yield on_headers
                    for r in wire.streamed_body(b"".join(chunks), end_of_stream=False):
                        yield r
                yield wire.CONTINUE_REQUEST_TRAILERS
            elif kind == "response_headers":
                yield resp_headers
            elif kind == "response_body":
                # A gateway's FULL_DUPLEX response body: every chunk back as it came.
                yield wire.echo_response_body(msg.response_body)
            elif kind == "response_trailers":
                yield wire.CONTINUE_RESPONSE_TRAILERS

    async def access_logs(requests, context):
        async for _ in requests:
            pass
        return access_log_pb2.StreamAccessLogsResponse()

    handler = grpc.stream_stream_rpc_method_handler(
        process,
        request_deserializer=wire.ProcessingRequest.FromString,
        response_serializer=wire.ProcessingResponse.SerializeToString,
    )
    logs = grpc.stream_unary_rpc_method_handler(
        access_logs,
        request_deserializer=access_log_pb2.StreamAccessLogsMessage.FromString,
        response_serializer=access_log_pb2.StreamAccessLogsResponse.SerializeToString,
    )
    # max_streams > 0: SETTINGS_MAX_CONCURRENT_STREAMS per connection (what a client sees).
    opts = [("grpc.max_concurrent_streams", max_streams)] if max_streams else []
    server = grpc.aio.server(options=opts + list(options))
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(protocol.EXT_PROC_SERVICE, {"Process": handler}),
            grpc.method_handlers_generic_handler(ACCESS_LOG_SERVICE, {"StreamAccessLogs": logs}),
        )
    )
    # Envoy health-checks the picker cluster, so the floor answers health too.
    healthy = health.aio.HealthServicer()
    for name in protocol.HEALTH_SERVICES:  # what our bootstrap and the gateways probe
        await healthy.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(healthy, server)
    address = f"127.0.0.1:{port}"
    if tls:
        server.add_secure_port(address, server_credentials(self_signed()))
    else:
        server.add_insecure_port(address)
    await server.start()
    await server.wait_for_termination()


def main(argv: list[str]) -> None:
    port, destination, flags = int(argv[1]), argv[2], argv[3:]

    def flag(name: str, default: str) -> str:
        return next((f.split("=", 1)[1] for f in flags if f.startswith(f"--{name}=")), default)

    tls = "--plaintext" not in flags
    options = tuple(
        (name, int(value) if value.lstrip("-").isdigit() else value)
        for name, value in (
            f.split("=", 1)[1].rsplit("=", 1) for f in flags if f.startswith("--option=")
        )
    )
    transport, loop = flag("transport", "aio"), flag("loop", "uvloop")
    run = uvloop.run if loop == "uvloop" else asyncio.run
    if transport == "aio":
        streams = int(flag("max-streams", "0"))
        run(serve(port, destination, tls=tls, max_streams=streams, options=options))
    elif transport == "sync":
        from floor_transports import serve_sync  # bench/ is on the path

        threads = int(flag("threads", "64"))
        serve_sync(port, destination, tls=tls, threads=threads, options=list(options))
    elif transport == "grpclib":
        from floor_transports import serve_grpclib

        run(serve_grpclib(port, destination, tls=tls))
    elif transport == "pyvoy":
        threads = int(flag("envoy-concurrency", "0"))
        exec_pyvoy(port, destination, tls=tls, envoy_threads=threads, app=flag("app", ""))
    else:
        raise SystemExit(f"unknown transport {transport!r}")


def exec_pyvoy(
    port: int, destination: str, *, tls: bool, envoy_threads: int = 0, app: str = ""
) -> None:
    """pyvoy's CLI in this process's place (it starts Envoy hosting the interpreter as its
    child: the bench charges the process tree). pyvoy is not a project dependency: the bench
    puts it on PYTHONPATH (`pip install --target DIR pyvoy`)."""
    import os
    import tempfile

    from extproc.server.tls import self_signed

    log_level = os.environ.get("FLOOR_PYVOY_LOG", "warn")  # pyvoy's Envoy: debug shows resets
    argv = [sys.executable, "-c", "from pyvoy._cli import main; main()", app or "floor_pyvoy:app",
            "--address", "127.0.0.1", "--port", str(port), "--log-level", log_level]  # fmt: skip
    if tls:
        pair = self_signed()
        tmp = tempfile.mkdtemp(prefix="floor-pyvoy-")
        key, cert = os.path.join(tmp, "key.pem"), os.path.join(tmp, "cert.pem")
        with open(key, "wb") as f:
            f.write(pair.key_pem)
        with open(cert, "wb") as f:
            f.write(pair.cert_pem)
        argv += ["--tls-key", key, "--tls-cert", cert, "--tls-disable-http3"]
    if envoy_threads:  # Envoy's worker threads (its default: one per core)
        argv += ["--", "--concurrency", str(envoy_threads)]
    env = {**os.environ, "FLOOR_DESTINATION": destination, "PICKER_ENDPOINT": destination}
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), here) if p)
    os.execve(sys.executable, argv, env)


if __name__ == "__main__":
    main(sys.argv)
