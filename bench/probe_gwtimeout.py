"""Which of Envoy 1.40's timers bound a slow or frozen picker, phase by phase, under the real
gateways' ext_proc settings (extproc/gateways.py) and our own bootstrap: the facts behind
docs/gateways.md "A slow or frozen picker".

A scripted ext_proc server (each request's `x-probe` header says where it stalls and for
how long), one echo upstream, Envoy configured as each gateway (plaintext to the server,
routed on the destination header; the ext_proc filter settings are the gateways' own). The
gateways' long timers (message_timeout 300 / 1000 s, the HCM's stream idle timeout) cannot
be waited out in a benchmark hold, so variants with one timer shortened show which phases
each one covers; the real settings then tell how long it takes.

    flock /tmp/extproc-bench.lock .venv/bin/python bench/probe_gwtimeout.py

`x-probe` actions (ms: how long the server sits on the message, not reading the stream):
  echo              answer everything at once (the control)
  reqhdr:ms         before the routing decision (FULL_DUPLEX_STREAMED: after the request
                    body ended; BUFFERED / STREAMED: before answering the request headers)
  reqbody:ms        before answering the first request-body message (BUFFERED / STREAMED)
  resphdr:ms        before answering the response headers
  respbody:k:ms     after answering k response-body messages
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from probe_gwdrain import (  # bench/ is on the path
    PROBE_HEADER,
    envoy_in_front,
    one,
    print_runs,
    route_to,
)

from extproc.bootstrap import BootstrapOptions, build_bootstrap
from extproc.gateways import (
    AI_GATEWAY,
    AI_GATEWAY_BUFFERED,
    ISTIO,
    LLM_D,
    Gateway,
    Mode,
    gateway_bootstrap,
)
from extproc.server import wire
from extproc.stack import wait_until

ENVOY_FLAGS = ("--concurrency", "1", "--log-level", "warn")
# Upstream response: 40 chunks of 200 bytes, 30 ms apart (1.2 s).
CHUNKS, SIZE, GAP_MS = 40, 200, 30


@dataclass(frozen=True)
class Setup:
    """One Envoy: a gateway's filter (or ours), optionally with one timer changed."""

    request_body: Mode
    response_body: Mode | None  # None: our bootstrap's (no response body)
    bootstrap: Callable[[BootstrapOptions], dict[str, Any]]
    scenarios: tuple[str, ...]


REAL = (
    "echo",
    "reqhdr:3000",
    "reqhdr:12000",  # past Istio's and llm-d's 10 s gRPC timeout
    "reqhdr:17000",  # past the AI Gateway's 15 s route timeout
    "resphdr:3000",
    "resphdr:17000",
    "respbody:10:3000",
    "respbody:10:17000",
)
MECHANISM = ("echo", "reqhdr:3000", "reqbody:3000", "resphdr:3000", "respbody:10:3000")
IDLE = ("echo", "reqhdr:6000", "resphdr:6000", "respbody:10:6000")


def _plain(gw: Gateway, **changes: Any) -> Gateway:
    # No health check of the scripted server, plaintext, routed on the destination header.
    fields = {"tls": False, "routing": "original-dst", "served_key": False}
    return replace(gw, health_service=None, **fields, **changes)


def _gateway(gw: Gateway, scenarios: tuple[str, ...], idle_s: float | None = None) -> Setup:
    def build(opts: BootstrapOptions) -> dict[str, Any]:
        doc = gateway_bootstrap(gw, opts)
        if idle_s is not None:
            _hcm(doc)["stream_idle_timeout"] = f"{idle_s:g}s"
        return doc

    return Setup(gw.request_body, gw.response_body, build, scenarios)


def _ours(scenarios: tuple[str, ...], **changes: Any) -> Setup:
    return Setup(
        "FULL_DUPLEX_STREAMED",
        None,
        lambda opts: build_bootstrap(replace(opts, **changes)),
        scenarios,
    )


def _hcm(doc: dict[str, Any]) -> dict[str, Any]:
    listener = doc["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


SETUPS: dict[str, Setup] = {
    # The real settings.
    "istio": _gateway(_plain(ISTIO), REAL),
    "aigw": _gateway(_plain(AI_GATEWAY), REAL),
    "aigw-buffered": _gateway(_plain(AI_GATEWAY_BUFFERED), REAL),
    "llm-d": _gateway(_plain(LLM_D), REAL),
    "ours": _ours(REAL),
    # message_timeout 1 s: which phases arm it, per body mode.
    "istio-mt1s": _gateway(_plain(ISTIO, message_timeout_s=1), MECHANISM),
    "aigw-buffered-mt1s": _gateway(_plain(AI_GATEWAY_BUFFERED, message_timeout_s=1), MECHANISM),
    "streamed-mt1s": _gateway(
        _plain(
            AI_GATEWAY,
            request_body="STREAMED",
            response_body="STREAMED",
            message_timeout_s=1,
        ),
        MECHANISM,
    ),
    "llm-d-mt1s": _gateway(_plain(LLM_D, message_timeout_s=1), MECHANISM),
    "ours-mt1s": _ours(MECHANISM, message_timeout_s=1.0),
    # The connection manager's stream_idle_timeout at 2 s (ours 600 s, Envoy's default 300 s).
    "istio-idle2s": _gateway(_plain(ISTIO), IDLE, idle_s=2),
}


class Probe:
    """The scripted ext_proc server."""

    def __init__(self, upstream: str, setup: Setup) -> None:
        self.upstream = upstream
        self.setup = setup

    async def process(self, requests, context):
        it = aiter(requests)
        first = await anext(it)
        action = wire.header_map(first.request_headers.headers).get(PROBE_HEADER, "echo")
        op, *args = action.split(":")
        nums = [int(a) for a in args]

        async def stall(where: str, done: int = 0) -> None:
            if op == where and (where != "respbody" or done == nums[0]):
                await asyncio.sleep(nums[-1] / 1000)

        duplex = self.setup.request_body == "FULL_DUPLEX_STREAMED"
        if not duplex:
            await stall("reqhdr")
            yield route_to(self.upstream)
        body = b""
        body_replies = resp_bodies = 0
        async for msg in it:
            kind = msg.WhichOneof("request")
            if kind == "request_body":
                if duplex:
                    body += msg.request_body.body
                    if msg.request_body.end_of_stream:
                        await stall("reqhdr")
                        await stall("reqbody")
                        yield route_to(self.upstream)
                        for r in wire.streamed_body(body, end_of_stream=True):
                            yield r
                else:
                    if body_replies == 0:
                        await stall("reqbody")
                    body_replies += 1
                    yield wire.CONTINUE_REQUEST_BODY
            elif kind == "request_trailers":
                yield wire.CONTINUE_REQUEST_TRAILERS
            elif kind == "response_headers":
                await stall("resphdr")
                yield wire.CONTINUE_RESPONSE_HEADERS
            elif kind == "response_body":
                if self.setup.response_body == "FULL_DUPLEX_STREAMED":
                    yield wire.echo_response_body(msg.response_body)
                else:
                    yield wire.CONTINUE_RESPONSE_BODY
                resp_bodies += 1
                await stall("respbody", resp_bodies)
            elif kind == "response_trailers":
                yield wire.CONTINUE_RESPONSE_TRAILERS


STAT_WORDS = (
    "ext_proc",
    "downstream_rq_idle_timeout",
    "upstream_rq_timeout",
    "upstream_rq_per_try_idle_timeout",
    "downstream_rq_timeout",
)


async def run_setup(name: str, setup: Setup, tmp: Path, log: Path) -> list[str]:
    out: list[str] = []

    def process_for(upstream: str):
        return Probe(upstream, setup).process

    async with envoy_in_front(name, process_for, setup.bootstrap, tmp, log) as bench:
        if setup.response_body is None:
            # Our bootstrap has the health check: wait until the server is seen healthy.
            await asyncio.to_thread(
                wait_until,
                lambda: "healthy" in _clusters(bench.admin),
                timeout_s=30,
                what="picker healthy",
            )
        base = f"http://127.0.0.1:{bench.listen}"
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            results = await asyncio.gather(
                *(one(c, s, CHUNKS, SIZE, GAP_MS, 0) for s in setup.scenarios)
            )
        stats = httpx.get(f"http://127.0.0.1:{bench.admin}/stats").text
        for action, (status, verdict, took) in zip(setup.scenarios, results, strict=True):
            out.append(f"{name:19} {action:18} HTTP {status} {took:5.1f} s  {verdict}")
        counters = " ".join(
            f"{k.split('.', 1)[-1]}={v.strip()}"
            for k, _, v in (line.partition(": ") for line in stats.splitlines())
            if v.strip() not in ("", "0") and any(w in k for w in STAT_WORDS)
        )
        out.append(f"{name:19} envoy: {counters}")
    return out


def _clusters(admin: int) -> str:
    text = httpx.get(f"http://127.0.0.1:{admin}/clusters", timeout=1).text
    flags = [line for line in text.splitlines() if "extproc::" in line and "health_flags" in line]
    return " ".join(flags) if flags and all("healthy" in f for f in flags) else ""


async def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--setups", default=",".join(SETUPS))
    args = p.parse_args()

    async def run(name: str, tmp: Path, log: Path) -> list[str]:
        return await run_setup(name, SETUPS[name], tmp, log)

    await print_runs("probe-gwtimeout-", args.setups.split(","), run)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
