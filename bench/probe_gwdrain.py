"""What Envoy 1.40 does when an ext_proc server ends its stream mid-response-body under the
real gateways' settings (extproc/gateways.py: response body FULL_DUPLEX_STREAMED, trailers
SEND), the facts behind the picker's SIGTERM drain (docs/reliability.md "Rolling restarts").

A scripted ext_proc server (not the picker: each request's `x-probe` header says what its
stream does to the response body), one echo upstream streaming numbered chunks, and Envoy
configured as each gateway (plaintext to the probe; TLS changes nothing here). Per request:
what the client received (intact / which chunks are missing / cut) and the gRPC deadline
the server saw on the stream. All requests of one gateway run at once.

    flock /tmp/extproc-bench.lock .venv/bin/python bench/probe_gwdrain.py

`x-probe` actions (k counts response-body messages echoed so far):
  echo                 echo every chunk (the control)
  close-after:k        after echoing k chunks, end the stream with OK at once
  stall-close:k:ms     after echoing k chunks, read nothing for ms, then end with OK
  read-close:k         read chunk k+1 but do not echo it, then end with OK
  abort-after:k        after echoing k chunks, fail the stream (UNAVAILABLE), as a dying picker
  pause:k:ms           after echoing k chunks, read nothing for ms, then echo on
  hdr-pause:ms         wait ms before answering the response headers
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import httpx
import orjson
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc import protocol
from extproc._proto.extproc.wire.v1 import ext_proc_pb2 as pb
from extproc.bootstrap import BootstrapOptions
from extproc.gateways import AI_GATEWAY, ISTIO, LLM_D, Gateway, gateway_bootstrap
from extproc.server import wire
from extproc.sim import echo
from extproc.stack import envoy_binary, free_port, wait_until

PROBE_HEADER = "x-probe"
ENVOY_FLAGS = ("--concurrency", "1", "--log-level", "warn")
CHUNK = re.compile(rb"data: (\d{6}) ")


def _probe_gateways() -> dict[str, Gateway]:
    # Routed on the destination header everywhere (Istio's override_host needs the lb
    # metadata the probe does not send; the ext_proc filter settings are what matter), no
    # health checks of the probe, plaintext.
    plain = {"tls": False, "routing": "original-dst", "served_key": False, "health_service": None}
    return {
        "istio": replace(ISTIO, **plain),  # type: ignore[arg-type]
        "aigw": replace(AI_GATEWAY, **plain),  # type: ignore[arg-type]
        "llm-d": replace(LLM_D, **plain),  # type: ignore[arg-type]
        # The AI Gateway with a 1 s message_timeout: does it apply to a held body stream?
        "aigw-mt1s": replace(AI_GATEWAY, message_timeout_s=1, **plain),  # type: ignore[arg-type]
    }


@dataclass
class Seen:
    deadline_s: float | None = None  # the gRPC deadline left when the stream opened
    echoed: int = 0
    ended: str = ""


class Probe:
    """The scripted ext_proc server."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.seen: dict[str, Seen] = {}

    async def process(self, requests, context):
        seen = Seen(deadline_s=context.time_remaining())
        it = aiter(requests)
        first = await anext(it)
        headers = wire.header_map(first.request_headers.headers)
        action = headers.get(PROBE_HEADER, "echo")
        self.seen[action] = seen
        op, *args = action.split(":")
        nums = [int(a) for a in args if a.isdigit()]
        body = b""
        async for msg in it:
            kind = msg.WhichOneof("request")
            if kind == "request_body":
                body += msg.request_body.body
                if msg.request_body.end_of_stream:
                    yield self._route()
                    for r in wire.streamed_body(body, end_of_stream=True):
                        yield r
            elif kind == "request_trailers":
                yield wire.CONTINUE_REQUEST_TRAILERS
            elif kind == "response_headers":
                if op == "hdr-pause":
                    await asyncio.sleep(nums[0] / 1000)
                yield wire.CONTINUE_RESPONSE_HEADERS
            elif kind == "response_body":
                if op == "read-close" and seen.echoed == nums[0]:
                    seen.ended = "ok-unechoed"
                    return
                yield wire.echo_response_body(msg.response_body)
                seen.echoed += 1
                if op in ("close-after", "stall-close", "abort-after", "pause") and (
                    seen.echoed == nums[0]
                ):
                    if op == "close-after":
                        seen.ended = "ok"
                        return
                    if op == "abort-after":
                        seen.ended = "aborted"
                        await context.abort(grpc.StatusCode.UNAVAILABLE, "probe")
                    await asyncio.sleep(nums[1] / 1000)
                    if op == "stall-close":
                        seen.ended = "ok-after-stall"
                        return
            elif kind == "response_trailers":
                yield wire.CONTINUE_RESPONSE_TRAILERS
        seen.ended = seen.ended or "envoy-closed"

    def _route(self) -> pb.ProcessingResponse:
        return route_to(self.upstream)


def route_to(upstream: str) -> pb.ProcessingResponse:
    """The request-headers reply that routes to `upstream` (the destination header)."""
    resp = pb.ProcessingResponse()
    mutation = resp.request_headers.response.header_mutation
    opt = mutation.set_headers.add()
    opt.header.key = protocol.DESTINATION_HEADER
    opt.header.raw_value = upstream.encode()
    resp.request_headers.response.clear_route_cache = True
    return resp


def check(got: bytes, chunks: int, size: int) -> str:
    """What the client got against what the upstream sent."""
    line, _, rest = got.partition(b"\n")
    try:
        orjson.loads(line)
    except orjson.JSONDecodeError:
        return f"no payload line ({len(got)} bytes)"
    want = b"".join(echo.stream_chunk(i, size) for i in range(chunks))
    if rest == want:
        return "intact"
    ids = [int(m.group(1)) for m in CHUNK.finditer(rest)]
    missing = sorted(set(range(chunks)) - set(ids))
    dup = len(ids) - len(set(ids))
    span = f"{missing[0]}..{missing[-1]}" if missing else "-"
    return f"{len(missing)} chunks missing ({span}), {dup} duplicated, {len(rest)}/{len(want)} B"


async def one(
    client: httpx.AsyncClient, action: str, chunks: int, size: int, gap_ms: int, wait_ms: int
) -> tuple[int, str, float]:
    headers = {
        PROBE_HEADER: action,
        echo.CHUNKS_HEADER: str(chunks),
        echo.CHUNK_BYTES_HEADER: str(size),
        echo.CHUNK_GAP_HEADER: str(gap_ms),
        echo.HEADERS_DELAY_HEADER: str(wait_ms),
    }
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    t0 = time.monotonic()
    got = b""
    status = 0
    try:
        async with client.stream(
            "POST", "/v1/chat/completions", content=body, headers=headers
        ) as r:
            status = r.status_code
            async for part in r.aiter_raw():
                got += part
        verdict = check(got, chunks, size) if status == 200 else repr(got[:80])
    except httpx.HTTPError as exc:
        verdict = f"cut ({type(exc).__name__}); then " + check(got, chunks, size)
    return status, verdict, time.monotonic() - t0


SCENARIOS: list[tuple[str, int, int, int, int]] = [
    # action, chunks, bytes per chunk, gap between chunks (ms), upstream headers delay (ms)
    ("echo", 40, 200, 30, 0),
    ("close-after:10", 40, 200, 30, 0),
    ("close-after:1", 40, 200, 30, 0),
    ("read-close:10", 40, 200, 30, 0),
    ("stall-close:10:300", 40, 200, 30, 0),
    ("abort-after:10", 40, 200, 30, 0),
    ("pause:10:3000", 40, 200, 30, 0),
    ("hdr-pause:3000", 10, 200, 30, 0),
    # Past Istio's and llm-d's 10 s gRPC timeout: a response streaming for 12 s, and one
    # whose headers come after 12 s (the stream idle that long).
    ("echo:long", 60, 200, 200, 0),
    ("echo:late-headers", 5, 200, 30, 12_000),
]


@dataclass(frozen=True)
class Bench:
    """What `envoy_in_front` runs: Envoy's listen and admin ports, the upstream's address."""

    listen: int
    admin: int
    upstream: str


@contextlib.asynccontextmanager
async def envoy_in_front(
    name: str,
    process_for: Callable[[str], Any],
    bootstrap: Callable[[BootstrapOptions], dict[str, Any]],
    tmp: Path,
    log: Path,
) -> AsyncIterator[Bench]:
    """An echo upstream, a scripted ext_proc server (`process_for(upstream)` serves each
    stream; it also answers gRPC health `readiness`, which our bootstrap checks) and Envoy
    configured by `bootstrap`, all ready; stopped on leaving."""
    upstream = f"127.0.0.1:{free_port()}"
    probe_port, listen, admin = free_port(), free_port(), free_port()
    ups = subprocess.Popen(
        [sys.executable, "-m", "extproc.sim.echo", upstream],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    server = grpc.aio.server()
    method = grpc.stream_stream_rpc_method_handler(
        process_for(upstream),
        request_deserializer=pb.ProcessingRequest.FromString,
        response_serializer=pb.ProcessingResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(protocol.EXT_PROC_SERVICE, {"Process": method}),)
    )
    checks = health.aio.HealthServicer()
    await checks.set("readiness", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    server.add_insecure_port(f"127.0.0.1:{probe_port}")
    await server.start()
    opts = BootstrapOptions(
        listen_port=listen,
        listen_address="127.0.0.1",
        extproc=f"127.0.0.1:{probe_port}",
        endpoints=(upstream,),
        admin_port=admin,
        extproc_tls=False,
        access_log=False,
    )
    cfg = tmp / f"envoy-{name}.yaml"
    cfg.write_text(yaml.safe_dump(bootstrap(opts), sort_keys=False))
    envoy = subprocess.Popen(
        [envoy_binary(), "-c", str(cfg), "--disable-hot-restart", *ENVOY_FLAGS],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )
    try:
        await asyncio.to_thread(
            wait_until,
            lambda: httpx.get(f"http://{upstream}/health", timeout=0.5).status_code == 200,
            timeout_s=20,
            what="upstream",
        )
        await asyncio.to_thread(
            wait_until,
            lambda: httpx.get(f"http://127.0.0.1:{admin}/ready", timeout=0.5).status_code == 200,
            timeout_s=30,
            what="envoy",
        )
        yield Bench(listen, admin, upstream)
    finally:
        envoy.terminate()
        ups.terminate()
        envoy.wait(10)
        ups.wait(10)
        await server.stop(0)


async def run_gateway(name: str, gw: Gateway, tmp: Path, log: Path) -> list[str]:
    probes: list[Probe] = []

    def process_for(upstream: str):
        probes.append(Probe(upstream))
        return probes[-1].process

    out: list[str] = []
    bootstrap = partial(gateway_bootstrap, gw)
    async with envoy_in_front(name, process_for, bootstrap, tmp, log) as bench:
        probe = probes[0]
        scenarios = [s for s in SCENARIOS if "pause" in s[0] or name != "aigw-mt1s"]
        base = f"http://127.0.0.1:{bench.listen}"
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            results = await asyncio.gather(*(one(c, *s) for s in scenarios))
        stats = httpx.get(
            f"http://127.0.0.1:{bench.admin}/stats", params={"filter": "ext_proc"}
        ).text
        for (action, *_), (status, verdict, took) in zip(scenarios, results, strict=True):
            seen = probe.seen.get(action, Seen())
            dl = "none" if seen.deadline_s is None else f"{seen.deadline_s:.1f} s"
            out.append(
                f"{name:10} {action:20} HTTP {status} {took:5.1f} s  {verdict}"
                f"  [picker echoed {seen.echoed}, ended {seen.ended or '-'}; deadline {dl}]"
            )
        counters = " ".join(
            f"{k.rsplit('.', 1)[-1]}={v}"
            for k, _, v in (line.partition(": ") for line in stats.splitlines())
            if v.strip() not in ("", "0") and "ext_proc" in k
        )
        out.append(f"{name:10} envoy: {counters}")
    return out


async def print_runs(
    prefix: str, names: list[str], run: Callable[[str, Path, Path], Awaitable[list[str]]]
) -> None:
    """`run(name, tmp, envoy_log)` for each name in turn, printing its lines, then the tail
    of Envoy's log."""
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        tmp = Path(d)
        for name in names:
            for line in await run(name, tmp, tmp / "envoy.log"):
                print(line, flush=True)
        tail = (tmp / "envoy.log").read_text(errors="replace")[-1500:]
        if tail:
            print("envoy log tail:\n" + tail)


async def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gateways", default=",".join(_probe_gateways()))
    args = p.parse_args()
    gws = _probe_gateways()

    async def run(name: str, tmp: Path, log: Path) -> list[str]:
        return await run_gateway(name, gws[name], tmp, log)

    await print_runs("probe-gwdrain-", args.gateways.split(","), run)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
