"""Issue 17's spike, second half: the picker's own ext_proc and access-log handlers (a real
`App`, its `StreamHandler` and `AccessLogHandler`, default settings, one static endpoint) served
by pyvoy through `floor_transports.asgi_grpc` instead of grpc.aio, so the picker's cost on that
transport is measured rather than estimated. A measurement device, not a supported way to run
extproc: no TLS reload, no workers.

Knobs (environment), for the eighth session's moderate-load trace:
- PICKER_GRPC: the App's own ports still served on grpc.aio beside pyvoy, comma list of
  `ext_proc`, `health` (default both; "" starts no grpc.aio server in the process);
- PICKER_TRACE=FILE: per-stream timings (first message in -> first reply out, each reply's
  wait on `send`) and the loop's lag, percentiles rewritten to FILE every ~0.5 s;
- PICKER_COALESCE=1: replies queue while a send is in flight and leave as one body event;
- PICKER_SWITCH_S: the interpreter's GIL switch interval.

    PICKER_ENDPOINT=HOST:PORT pyvoy picker_pyvoy:app ...   (floor_processor.py --transport=pyvoy
    --app=picker_pyvoy:app starts it)
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time

from floor_transports import asgi_grpc

from extproc import protocol
from extproc._proto.extproc.wire.v1 import access_log_pb2
from extproc.config import Settings
from extproc.endpoints import parse_endpoints
from extproc.server import wire
from extproc.server.access_log import SERVICE as ACCESS_LOG_SERVICE
from extproc.server.app import App

ENDPOINT = os.environ.get("PICKER_ENDPOINT", "127.0.0.1:18000")


class _Context:
    """What the handlers ask of grpc.aio's servicer context."""

    def peer(self) -> str:
        return "ipv4:127.0.0.1:0"

    async def abort(self, code, details):
        raise RuntimeError(f"{code}: {details}")


_state: dict = {}


async def _startup() -> None:
    # PICKER_SWITCH_S: the interpreter's GIL switch interval (default 5 ms); Envoy's worker
    # thread takes the GIL to hand each event to the loop's thread.
    if switch := os.environ.get("PICKER_SWITCH_S"):
        sys.setswitchinterval(float(switch))
    base = Settings(endpoints=[ENDPOINT])
    settings = Settings(
        endpoints=[ENDPOINT],
        server=type(base.server)(port=0, health_port=0, admin_port=None),
    )
    # PICKER_GRPC: which of the App's own ports run on grpc.aio beside pyvoy ("ext_proc,health"
    # as before, "health", or "" for none: grpc.aio never started in the process).
    ports = os.environ.get("PICKER_GRPC", "ext_proc,health")
    grpc_ports = frozenset(p for p in ports.split(",") if p)
    picker = App(settings, parse_endpoints(ENDPOINT), grpc_ports=grpc_ports)
    await picker.__aenter__()
    _state["app"] = picker
    _state["handler"] = picker.stream_handler
    if _TRACE:
        _state["lag"] = asyncio.create_task(_sample_lag())


async def _shutdown() -> None:
    await _state["app"].__aexit__(None, None, None)


_TRACE = os.environ.get("PICKER_TRACE")  # a file: per-stream timings, rewritten every 2 s
_trace: dict[str, list[float]] = {"decide": [], "send": [], "lag": []}


async def _timed(requests, marks: list[float]):
    async for msg in requests:
        if not marks:
            marks.append(time.perf_counter())
        yield msg


async def _process(requests, emit) -> None:
    if not _TRACE:
        async for reply in _state["handler"].process(requests, _Context()):
            await emit((reply,))
        return
    marks: list[float] = []
    first = True
    async for reply in _state["handler"].process(_timed(requests, marks), _Context()):
        t = time.perf_counter()
        if first and marks:
            # first message in -> first reply out: the picker's own time for the stream
            _trace["decide"].append(t - marks[0])
            first = False
        await emit((reply,))
        _trace["send"].append(time.perf_counter() - t)


async def _sample_lag() -> None:
    while True:
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        _trace["lag"].append(time.perf_counter() - t - 0.001)
        if len(_trace["lag"]) % 500 == 0:
            with open(_TRACE, "w") as f:
                for k, v in _trace.items():
                    q = statistics.quantiles(v, n=100) if len(v) > 2 else [0] * 99
                    f.write(f"{k} n={len(v)} p50={q[49] * 1e3:.3f}ms p90={q[89] * 1e3:.3f}ms\n")
            for v in _trace.values():
                del v[:-5000]


async def _access_logs(requests, emit) -> None:
    await emit((await _state["app"].access_log.stream(requests, _Context()),))


app = asgi_grpc(
    {
        protocol.EXT_PROC_METHOD: (wire.ProcessingRequest, _process),
        f"/{ACCESS_LOG_SERVICE}/StreamAccessLogs": (
            access_log_pb2.StreamAccessLogsMessage,
            _access_logs,
        ),
    },
    startup=_startup,
    shutdown=_shutdown,
    coalesce=os.environ.get("PICKER_COALESCE") == "1",
)
