"""The picker's own Python work per request, without the transport: the ext_proc messages Envoy
sends for one 1 KB chat request (FULL_DUPLEX_STREAMED: headers, body; response headers only
with `--response-headers`, as `envoy-config --response-headers send` configures; and its
access-log entry) decoded from bytes, fed through the real `StreamHandler` of a real `App`
(default settings, one static endpoint), and every reply encoded, as grpc.aio would. The floor
processor's loop runs on the same messages. CPU per request of each, interleaved, medians; then
a cProfile of the picker's loop, to read the gap above the floor function by function.

    uv run python bench/profile_stream.py [--requests 3000] [--rounds 5] [--profile 20]
        [--response-headers]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
import uuid

from extproc._proto.extproc.wire.v1 import access_log_pb2
from extproc.config import Settings
from extproc.core import Decision, Endpoint
from extproc.endpoints import parse_endpoints
from extproc.server import wire
from extproc.server.access_log import entries
from extproc.server.app import App
from extproc.server.limits import BodyBudget
from extproc.server.stream import StreamHandler
from extproc.testing import post, request_body, request_headers, response_headers

ENDPOINT = "127.0.0.1:18000"
BODY = (
    b'{"model":"m","messages":[{"role":"user","content":"'
    + b"The quick brown fox jumps over the lazy dog. " * 21
    + b'"}]}'
)
# What Envoy adds to a client's request before ext_proc sees it.
ENVOY_HEADERS = {
    "user-agent": "wrk",
    "content-length": str(len(BODY)),
    "x-forwarded-proto": "http",
    "accept": "*/*",
}


class _Context:
    def peer(self) -> str:
        return "ipv4:127.0.0.1:40000"

    async def abort(self, code, details):  # pragma: no cover - never reached here
        raise RuntimeError(details)


def messages() -> tuple[bytes, bytes, bytes, str]:
    rid = uuid.uuid4().hex
    hdrs = request_headers(post("/v1/chat/completions", {**ENVOY_HEADERS, "x-request-id": rid}))
    body = request_body(BODY, end_of_stream=True)
    resp = response_headers(200, served=ENDPOINT)
    return (
        hdrs.SerializeToString(),
        body.SerializeToString(),
        resp.SerializeToString(),
        rid,
    )


def access_log_bytes(rid: str) -> bytes:
    msg = access_log_pb2.StreamAccessLogsMessage()
    e = msg.http_logs.log_entry.add()
    e.request.request_id = rid
    e.common_properties.time_to_first_upstream_rx_byte.nanos = 400_000
    e.response.response_code.value = 200
    e.response.response_body_bytes = 300
    sa = e.common_properties.upstream_remote_address.socket_address
    sa.address, sa.port_value = "127.0.0.1", 18000
    return msg.SerializeToString()


async def _aiter(items):
    for item in items:
        yield item


async def picker_requests(handler: StreamHandler, app: App, n: int, phases: int) -> None:
    ctx = _Context()
    decode = wire.ProcessingRequest.FromString
    encode = wire.ProcessingResponse.SerializeToString
    ends = app.access_log
    for _ in range(n):
        raw = messages()
        msgs = [decode(b) for b in raw[:phases]]
        async for resp in handler.process(_aiter(msgs), ctx):
            encode(resp)
        # Envoy batches entries; one per request is what the picker decodes in the end.
        for entry in entries(access_log_pb2.StreamAccessLogsMessage.FromString(
            access_log_bytes(raw[3])
        )):  # fmt: skip
            ends._ends.ended(entry)


async def floor_requests(n: int, phases: int) -> None:
    decision = Decision(endpoints=(Endpoint(ENDPOINT),))
    on_headers = wire.routed_headers(decision)
    decode = wire.ProcessingRequest.FromString
    encode = wire.ProcessingResponse.SerializeToString
    for _ in range(n):
        raw = messages()
        chunks: list[bytes] = []
        for b in raw[:phases]:
            msg = decode(b)
            kind = msg.WhichOneof("request")
            if kind == "request_body":
                chunks.append(msg.request_body.body)
                if msg.request_body.end_of_stream:
                    encode(on_headers)
                    for r in wire.streamed_body(b"".join(chunks), end_of_stream=True):
                        encode(r)
            elif kind == "response_headers":
                encode(wire.CONTINUE_RESPONSE_HEADERS)
        access_log_pb2.StreamAccessLogsMessage.FromString(access_log_bytes(raw[3]))


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", type=int, default=20, help="functions listed (0: no profile)")
    ap.add_argument("--response-headers", action="store_true", help="send the third phase")
    args = ap.parse_args()
    phases = 3 if args.response_headers else 2
    settings = Settings(endpoints=[ENDPOINT])
    settings = Settings(
        endpoints=[ENDPOINT],
        server=type(settings.server)(port=0, health_port=0, admin_port=None),
    )
    async with App(settings, parse_endpoints(ENDPOINT)) as app:
        cfg = settings.server
        handler = StreamHandler(  # from_settings without registering the budget's gauges twice
            app.router,
            max_body_bytes=cfg.max_body_bytes,
            metrics=app.metrics,
            budget=BodyBudget(limit=cfg.body_budget_bytes),
            body_timeout_s=cfg.body_timeout_s,
        )
        await picker_requests(handler, app, 200, phases)  # warm up
        await floor_requests(200, phases)
        picker, floor = [], []
        for _ in range(args.rounds):
            for out, run in ((picker, lambda: picker_requests(handler, app, args.requests, phases)),
                             (floor, lambda: floor_requests(args.requests, phases))):  # fmt: skip
                t0 = time.process_time()
                await run()
                out.append((time.process_time() - t0) / args.requests * 1e6)
        p, f = statistics.median(picker), statistics.median(floor)
        print(f"picker Python work per request: {p:.0f} us (rounds: {picker})")
        print(f"floor  Python work per request: {f:.0f} us (rounds: {floor})")
        print(f"difference: {p - f:.0f} us per request")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            await picker_requests(handler, app, args.requests, phases)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile)
            print(s.getvalue())


if __name__ == "__main__":
    import uvloop

    uvloop.run(main())
