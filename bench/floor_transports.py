"""The floor processor (`floor_processor.py`) on transports other than grpc.aio, for issue 17's
question whether the ext_proc loop gets cheaper off grpc.aio: the same phases, the same replies,
the same TLS and the same access-log and health services, so one Envoy bootstrap fronts any of
them and only the transport differs.

- `sync`: grpcio's thread-pool server (`grpc.server`), the stream handler a generator over the
  blocking request iterator; one pool thread per open stream.
- `grpclib`: the pure-Python gRPC server on asyncio (HTTP/2 framing by `h2`), under uvloop or
  the default loop.

    python bench/floor_processor.py PORT DESTINATION --transport=sync|grpclib [--loop=asyncio]
"""

from __future__ import annotations

import asyncio
import os
import ssl
import tempfile
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc import protocol
from extproc._proto.extproc.wire.v1 import access_log_pb2
from extproc.core import Decision, Endpoint
from extproc.server import wire
from extproc.server.access_log import SERVICE as ACCESS_LOG_SERVICE
from extproc.server.tls import KeyPair, self_signed, server_credentials

_FULL_DUPLEX = wire.BodySendMode.FULL_DUPLEX_STREAMED


def replies(destination: str) -> Callable[[object], Iterator]:
    """The floor's per-message logic as a step function for transports that cannot share the
    aio floor's generator: `step(msg)` yields the replies to one message; state per stream."""
    decision = Decision(endpoints=(Endpoint(destination),))
    on_headers = wire.routed_headers(decision)
    on_body = wire.routed_body(decision)

    def new_stream():
        chunks: list[bytes] | None = []
        duplex = True

        def step(msg):
            nonlocal chunks, duplex
            kind = msg.WhichOneof("request")
            if kind == "request_headers":
                duplex = msg.protocol_config.request_body_mode == _FULL_DUPLEX
                if not duplex:
                    yield wire.CONTINUE_REQUEST_HEADERS
            elif kind == "request_body":
                if not duplex:
                    yield on_body
                    return
                chunks.append(msg.request_body.body)
                if msg.request_body.end_of_stream:
                    yield on_headers
                    yield from wire.streamed_body(b"".join(chunks), end_of_stream=True)
                    chunks = None
            elif kind == "request_trailers":
                if duplex and chunks is not None:
                    yield on_headers
                    yield from wire.streamed_body(b"".join(chunks), end_of_stream=False)
                yield wire.CONTINUE_REQUEST_TRAILERS
            elif kind == "response_headers":
                yield wire.CONTINUE_RESPONSE_HEADERS
            elif kind == "response_body":
                yield wire.echo_response_body(msg.response_body)
            elif kind == "response_trailers":
                yield wire.CONTINUE_RESPONSE_TRAILERS

        return step

    return new_stream


def serve_sync(port: int, destination: str, *, tls: bool, threads: int, options: list) -> None:
    decision = Decision(endpoints=(Endpoint(destination),))
    on_headers = wire.routed_headers(decision)
    on_body = wire.routed_body(decision)

    def process(requests, context):
        # The aio floor's loop, line for line, over a blocking iterator.
        chunks: list[bytes] | None = []
        duplex = True
        for msg in requests:
            kind = msg.WhichOneof("request")
            if kind == "request_headers":
                duplex = msg.protocol_config.request_body_mode == _FULL_DUPLEX
                if not duplex:
                    yield wire.CONTINUE_REQUEST_HEADERS
            elif kind == "request_body":
                if not duplex:
                    yield on_body
                    continue
                chunks.append(msg.request_body.body)
                if msg.request_body.end_of_stream:
                    yield on_headers
                    yield from wire.streamed_body(b"".join(chunks), end_of_stream=True)
                    chunks = None
            elif kind == "request_trailers":
                if duplex and chunks is not None:
                    yield on_headers
                    yield from wire.streamed_body(b"".join(chunks), end_of_stream=False)
                yield wire.CONTINUE_REQUEST_TRAILERS
            elif kind == "response_headers":
                yield wire.CONTINUE_RESPONSE_HEADERS
            elif kind == "response_body":
                yield wire.echo_response_body(msg.response_body)
            elif kind == "response_trailers":
                yield wire.CONTINUE_RESPONSE_TRAILERS

    def access_logs(requests, context):
        for _ in requests:
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
    # Every open stream holds a pool thread for its life: the pool bounds concurrent streams.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), options=options)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(protocol.EXT_PROC_SERVICE, {"Process": handler}),
            grpc.method_handlers_generic_handler(ACCESS_LOG_SERVICE, {"StreamAccessLogs": logs}),
        )
    )
    healthy = health.HealthServicer()
    for name in protocol.HEALTH_SERVICES:
        healthy.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(healthy, server)
    address = f"127.0.0.1:{port}"
    if tls:
        server.add_secure_port(address, server_credentials(self_signed()))
    else:
        server.add_insecure_port(address)
    server.start()
    server.wait_for_termination()


def _ssl_context(pair: KeyPair) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
        cert.write_bytes(pair.cert_pem)
        key.write_bytes(pair.key_pem)
        ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["h2"])
    return ctx


async def serve_grpclib(port: int, destination: str, *, tls: bool) -> None:
    from grpclib.const import Cardinality, Handler
    from grpclib.server import Server

    new_stream = replies(destination)

    async def process(stream) -> None:
        step = new_stream()
        async for msg in stream:
            for reply in step(msg):
                await stream.send_message(reply)

    async def access_logs(stream) -> None:
        async for _ in stream:
            pass
        await stream.send_message(access_log_pb2.StreamAccessLogsResponse())

    async def check(stream) -> None:
        await stream.recv_message()
        await stream.send_message(
            health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
        )

    class Servable:
        def __mapping__(self):
            return {
                protocol.EXT_PROC_METHOD: Handler(
                    process,
                    Cardinality.STREAM_STREAM,
                    wire.ProcessingRequest,
                    wire.ProcessingResponse,
                ),
                f"/{ACCESS_LOG_SERVICE}/StreamAccessLogs": Handler(
                    access_logs,
                    Cardinality.STREAM_UNARY,
                    access_log_pb2.StreamAccessLogsMessage,
                    access_log_pb2.StreamAccessLogsResponse,
                ),
                "/grpc.health.v1.Health/Check": Handler(
                    check,
                    Cardinality.UNARY_UNARY,
                    health_pb2.HealthCheckRequest,
                    health_pb2.HealthCheckResponse,
                ),
            }

    server = Server([Servable()])
    await server.start("127.0.0.1", port, ssl=_ssl_context(self_signed()) if tls else None)
    await asyncio.Event().wait()  # until killed


class Gone(Exception):
    """The stream was reset (Envoy's client went away): nothing more may be sent."""


async def _messages(receive, parse):
    """gRPC messages from ASGI request events: a 5-byte prefix (flag, big-endian length)."""
    buf = b""
    more = True
    while more:
        event = await receive()
        if event["type"] != "http.request":
            raise Gone
        buf += event.get("body", b"")
        more = event.get("more_body", False)
        while len(buf) >= 5:
            size = int.from_bytes(buf[1:5], "big")
            if len(buf) < 5 + size:
                break
            yield parse(buf[5 : 5 + size])
            buf = buf[5 + size :]


def _frames(replies) -> dict:
    # One body event for all the replies at hand: one hand-off to Envoy's thread.
    out = bytearray()
    for r in replies:
        payload = r.SerializeToString()
        out += b"\0" + len(payload).to_bytes(4, "big") + payload
    return {"type": "http.response.body", "body": bytes(out), "more_body": True}


def asgi_grpc(methods: dict, *, startup=None, shutdown=None, coalesce: bool = False):
    """A bare ASGI gRPC server for pyvoy (Envoy hosting the interpreter: HTTP/2, TLS and
    trailers in Envoy's C++, each request event a call into Python). `methods` maps a full
    method path to (request class, handler); `handler(requests, emit)` reads decoded messages
    from the async iterator and `await emit(replies)` sends a batch. Unknown paths answer the
    health check (every service SERVING), which is all Envoy asks of the processor otherwise."""
    health_ok = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
    start = {
        "type": "http.response.start",
        "status": 200,
        "headers": [(b"content-type", b"application/grpc")],
        "trailers": True,
    }
    body_end = {"type": "http.response.body", "body": b"", "more_body": False}
    ok_trailers = {
        "type": "http.response.trailers",
        "headers": [(b"grpc-status", b"0")],
        "more_trailers": False,
    }

    async def health(requests, emit):
        async for _ in requests:
            pass
        await emit((health_ok,))

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                if startup is not None:
                    await startup()
                await send({"type": "lifespan.startup.complete"})
            if shutdown is not None:
                await shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return
        cls, handler = methods.get(scope["path"], (health_pb2.HealthCheckRequest, health))
        await send(start)

        if coalesce:
            # Replies queue up while a send is in flight and leave as one body event: the
            # handler never waits on Envoy's thread between two replies.
            pending: list = []
            writer: list = []

            async def drain() -> None:
                while pending:
                    batch = pending[:]
                    pending.clear()
                    await send(_frames(batch))

            async def emit(replies) -> None:
                pending.extend(replies)
                if pending and (not writer or writer[0].done()):
                    writer[:] = [asyncio.ensure_future(drain())]
        else:

            async def emit(replies) -> None:
                out = _frames(replies)
                if out["body"]:
                    await send(out)

        try:
            await handler(_messages(receive, cls.FromString), emit)
            if coalesce and writer:
                await writer[0]
        except Gone:
            return
        await send(body_end)  # ASGI: trailers only after the last body event
        await send(ok_trailers)

    return app


def pyvoy_app(destination: str):
    """The floor on `asgi_grpc`: the same per-message logic as the other transports, each
    message's replies sent as one body event."""
    new_stream = replies(destination)

    # FLOOR_END_STREAM=1: close the stream after the response-header reply (the last phase
    # of our bootstrap) instead of waiting for Envoy to reset it.
    end_early = os.environ.get("FLOOR_END_STREAM") == "1"

    async def process(requests, emit) -> None:
        step = new_stream()
        async for msg in requests:
            await emit(step(msg))
            if end_early and msg.HasField("response_headers"):
                return

    async def access_logs(requests, emit) -> None:
        async for _ in requests:
            pass
        await emit((access_log_pb2.StreamAccessLogsResponse(),))

    return asgi_grpc(
        {
            protocol.EXT_PROC_METHOD: (wire.ProcessingRequest, process),
            f"/{ACCESS_LOG_SERVICE}/StreamAccessLogs": (
                access_log_pb2.StreamAccessLogsMessage,
                access_logs,
            ),
        }
    )
