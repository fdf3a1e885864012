"""Tiny upstreams that answer every request with who they are and what they saw.

Each listens on its own port and replies JSON: its name, the destination header Envoy
forwarded, the request path, the body size and a digest of the body (so a test can prove the
body arrived intact). The `x-served-by` response header carries the name too.

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

SERVED_BY_HEADER = "x-served-by"
DELAY_HEADER = "x-echo-delay-ms"  # request header: send the body this long after the headers
# Request header: answer (headers and all) only after this long, like a server that is busy
# with the request until its first byte (the picker counts a request in flight until then).
HEAD_DELAY_HEADER = "x-echo-head-delay-ms"


def make_app(name: str) -> web.Application:
    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        head_delay = request.headers.get(HEAD_DELAY_HEADER, "")
        if head_delay.isdigit():
            await asyncio.sleep(int(head_delay) / 1000)
        payload = {
            "endpoint": name,
            "destination_header": request.headers.get(protocol.DESTINATION_HEADER),
            "path": request.path_qs,
            "method": request.method,
            "body_bytes": len(body),
            "body_sha256": hashlib.sha256(body).hexdigest(),
        }
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
