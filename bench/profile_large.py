"""The picker's own Python work for one large new prompt, without the transport: a chat body
of 400 KB or 4 MB (every request a new first line, so its whole chain is new), cut into the
body chunks Envoy streams in FULL_DUPLEX_STREAMED, decoded from bytes and fed through the
real `StreamHandler` of a real `App`, every reply encoded. The floor processor's loop runs on
the same messages. CPU per request of each, interleaved, medians; then a cProfile.

    uv run python bench/profile_large.py [--kb 400] [--requests 40] [--rounds 5] [--profile 25]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_bodies import unique
from bench_parse import chat_body
from profile_stream import ENDPOINT, _aiter, _Context

from extproc.config import Settings
from extproc.core import Decision, Endpoint
from extproc.endpoints import parse_endpoints
from extproc.server import wire
from extproc.server.app import App
from extproc.server.limits import BodyBudget
from extproc.server.stream import StreamHandler
from extproc.testing import post, request_body, request_headers, response_headers

CHUNK = 64 * 1024  # what Envoy's buffers hand ext_proc per body message here, at most


def messages(body: bytes) -> list[bytes]:
    hdrs = request_headers(
        post("/v1/chat/completions", {"content-length": str(len(body)),
                                      "x-request-id": uuid.uuid4().hex})
    )  # fmt: skip
    out = [hdrs.SerializeToString()]
    for i in range(0, len(body), CHUNK):
        end = i + CHUNK >= len(body)
        out.append(request_body(body[i : i + CHUNK], end_of_stream=end).SerializeToString())
    out.append(response_headers(200, served=ENDPOINT).SerializeToString())
    return out


async def picker_requests(handler: StreamHandler, batch: list[list[bytes]]) -> None:
    ctx = _Context()
    decode = wire.ProcessingRequest.FromString
    encode = wire.ProcessingResponse.SerializeToString
    for raw in batch:
        async for resp in handler.process(_aiter([decode(b) for b in raw]), ctx):
            encode(resp)


async def floor_requests(batch: list[list[bytes]]) -> None:
    on_headers = wire.routed_headers(Decision(endpoints=(Endpoint(ENDPOINT),)))
    decode = wire.ProcessingRequest.FromString
    encode = wire.ProcessingResponse.SerializeToString
    for raw in batch:
        chunks: list[bytes] = []
        for b in raw:
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


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kb", type=int, default=400)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", type=int, default=25, help="functions listed (0: no profile)")
    args = ap.parse_args()
    base = chat_body(args.kb * 1024)
    counter = 0

    def batch(n: int) -> list[list[bytes]]:
        nonlocal counter
        counter += n
        return [messages(unique(base, counter - i)) for i in range(n)]

    settings = Settings(endpoints=[ENDPOINT])
    settings = Settings(
        endpoints=[ENDPOINT],
        server=type(settings.server)(port=0, health_port=0, admin_port=None),
    )
    async with App(settings, parse_endpoints(ENDPOINT)) as app:
        cfg = settings.server
        handler = StreamHandler(
            app.router,
            max_body_bytes=cfg.max_body_bytes,
            metrics=app.metrics,
            budget=BodyBudget(limit=cfg.body_budget_bytes),
            body_timeout_s=cfg.body_timeout_s,
        )
        await picker_requests(handler, batch(5))
        await floor_requests(batch(5))
        picker, floor = [], []
        for _ in range(args.rounds):
            b = batch(args.requests)
            for out, run in ((picker, picker_requests(handler, b)), (floor, floor_requests(b))):
                t0 = time.process_time()
                await run
                await asyncio.sleep(0)  # let deferred work scheduled by the round run
                out.append((time.process_time() - t0) / args.requests * 1e3)
        p, f = statistics.median(picker), statistics.median(floor)
        print(f"{args.kb} KB picker Python work per request: {p:.3f} ms (rounds: "
              f"{', '.join(f'{x:.3f}' for x in picker)})")  # fmt: skip
        print(f"{args.kb} KB floor  Python work per request: {f:.3f} ms (rounds: "
              f"{', '.join(f'{x:.3f}' for x in floor)})")  # fmt: skip
        if args.profile:
            b = batch(args.requests)
            prof = cProfile.Profile()
            prof.enable()
            await picker_requests(handler, b)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile)
            print(s.getvalue())


if __name__ == "__main__":
    import uvloop

    uvloop.run(main())
