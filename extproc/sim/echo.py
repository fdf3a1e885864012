"""Tiny upstreams that answer every request with who they are and what they saw.

Each listens on its own port and replies JSON: its name, the destination header Envoy
forwarded, the request path, the body size and a digest of the body (so a test can prove the
body arrived intact), and the engine priority the body and headers carry. The `x-served-by`
response header carries the name too.

    python -m extproc.sim.echo 127.0.0.1:8001 127.0.0.1:8002
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import signal
import sys

import orjson
from aiohttp import web

from extproc import protocol
from extproc.sim import SERVED_BY_HEADER

DELAY_HEADER = "x-echo-delay-ms"  # request header: send the body this long after the headers
# Request headers for a streamed answer: the JSON line, then CHUNKS chunks of CHUNK_BYTES
# (`stream_chunk(i, size)`), one every CHUNK_GAP_MS; HEADERS_DELAY_MS before anything at all
# (also without CHUNKS: a server busy with the request until its first byte).
CHUNKS_HEADER = "x-echo-chunks"
CHUNK_BYTES_HEADER = "x-echo-chunk-bytes"
CHUNK_GAP_HEADER = "x-echo-chunk-gap-ms"
HEADERS_DELAY_HEADER = "x-echo-headers-delay-ms"


def stream_chunk(i: int, size: int) -> bytes:
    """Chunk `i` of a streamed answer: deterministic, so the client can check every byte."""
    head = f"data: {i:06d} ".encode()
    return (head + b"x" * max(0, size - len(head) - 2) + b"\n\n")[:size]


def _int(value: str | None) -> int | None:
    return int(value) if value and value.isascii() and value.isdigit() else None


def _priority_seen(request: web.Request, body: bytes) -> dict:
    """What an engine with priority scheduling would read: the body's top-level `priority`
    (absent from the answer when the body has none), vLLM's `x-vllm-priority` header, and
    the declared content-length (a rewritten body must declare its new size)."""
    out: dict = {
        "vllm_priority_header": request.headers.get(protocol.ENGINE_PRIORITY_HEADER),
        # Every value: a header set by the picker must have replaced the client's, not
        # joined it (vLLM reads the first).
        "vllm_priority_headers": request.headers.getall(protocol.ENGINE_PRIORITY_HEADER, []),
        "content_length": request.headers.get("content-length"),
    }
    if b"priority" in body:  # only then parse: large bodies pass through untouched
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            out["body_json"] = False
            return out
        if isinstance(doc, dict) and "priority" in doc:
            out["priority"] = doc["priority"]
    return out


def make_app(name: str) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        payload = {
            "endpoint": name,
            "destination_header": request.headers.get(protocol.DESTINATION_HEADER),
            "path": request.path_qs,
            "method": request.method,
            "body_bytes": len(body),
            "body_sha256": hashlib.sha256(body).hexdigest(),
            # Headers the picker adds for disaggregated serving, as the server received them.
            "picker_headers": {
                k.lower(): v
                for k, v in request.headers.items()
                if k.lower()
                in (
                    protocol.PREFILLER_HEADER,
                    protocol.ENCODERS_HEADER,
                    protocol.DATA_PARALLEL_HEADER,
                )
            },
        }
        payload.update(_priority_seen(request, body))
        headers_delay = _int(request.headers.get(HEADERS_DELAY_HEADER))
        if headers_delay:
            await asyncio.sleep(headers_delay / 1000)
        chunks = _int(request.headers.get(CHUNKS_HEADER))
        if chunks is not None:
            return await _stream(request, payload, chunks)
        delay_ms = request.headers.get(DELAY_HEADER, "")
        if not delay_ms.isdigit():
            return web.Response(
                body=orjson.dumps(payload),
                content_type="application/json",
                headers={SERVED_BY_HEADER: name},
            )
        # Headers first, body after the delay: a response that takes time to finish, like a
        # model server streaming tokens.
        resp = web.StreamResponse(headers={SERVED_BY_HEADER: name})
        resp.content_type = "application/json"
        await resp.prepare(request)
        await asyncio.sleep(int(delay_ms) / 1000)
        await resp.write(orjson.dumps(payload))
        await resp.write_eof()
        return resp

    async def _stream(request: web.Request, payload: dict, chunks: int) -> web.StreamResponse:
        size = _int(request.headers.get(CHUNK_BYTES_HEADER)) or 64
        gap = (_int(request.headers.get(CHUNK_GAP_HEADER)) or 0) / 1000
        resp = web.StreamResponse(headers={SERVED_BY_HEADER: name})
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        await resp.write(orjson.dumps(payload) + b"\n")
        try:
            for i in range(chunks):
                if gap:
                    await asyncio.sleep(gap)
                await resp.write(stream_chunk(i, size))
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client went away mid-answer: nothing more to send
        return resp

    app = web.Application(client_max_size=256 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


async def serve(addresses: list[str]) -> None:
    runners = []
    for addr in addresses:
        host, _, port = addr.rpartition(":")
        runner = web.AppRunner(make_app(addr), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, int(port)).start()
        runners.append(runner)
    print(f"echo upstreams ready: {' '.join(addresses)}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for runner in runners:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m extproc.sim.echo")
    p.add_argument("addresses", nargs="+", help="ip:port to listen on, one upstream each")
    args = p.parse_args(argv)
    asyncio.run(serve(args.addresses))
    return 0


if __name__ == "__main__":
    sys.exit(main())
