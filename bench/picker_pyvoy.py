"""Issue 17's spike, second half: the picker's own ext_proc and access-log handlers (a real
`App`, its `StreamHandler` and `AccessLogHandler`, default settings, one static endpoint) served
by pyvoy through `floor_transports.asgi_grpc` instead of grpc.aio, so the picker's cost on that
transport is measured rather than estimated. A measurement device, not a supported way to run
extproc: the App still starts its own (idle) grpc.aio ports, no TLS reload, no workers.

    PICKER_ENDPOINT=HOST:PORT pyvoy picker_pyvoy:app ...   (floor_processor.py --transport=pyvoy
    --app=picker_pyvoy:app starts it)
"""

from __future__ import annotations

import os

from floor_transports import asgi_grpc

from extproc import protocol
from extproc._proto.extproc.wire.v1 import access_log_pb2
from extproc.config import Settings
from extproc.endpoints import parse_endpoints
from extproc.server import wire
from extproc.server.access_log import SERVICE as ACCESS_LOG_SERVICE
from extproc.server.app import App
from extproc.server.limits import BodyBudget
from extproc.server.stream import StreamHandler

ENDPOINT = os.environ.get("PICKER_ENDPOINT", "127.0.0.1:18000")


class _Context:
    """What the handlers ask of grpc.aio's servicer context."""

    def peer(self) -> str:
        return "ipv4:127.0.0.1:0"

    async def abort(self, code, details):
        raise RuntimeError(f"{code}: {details}")


_state: dict = {}


async def _startup() -> None:
    base = Settings(endpoints=[ENDPOINT])
    settings = Settings(
        endpoints=[ENDPOINT],
        server=type(base.server)(port=0, health_port=0, admin_port=None),
    )
    picker = App(settings, parse_endpoints(ENDPOINT))
    await picker.__aenter__()
    _state["app"] = picker
    cfg = settings.server
    # from_settings without registering the budget's gauges a second time (App did once).
    _state["handler"] = StreamHandler(
        picker.router,
        max_body_bytes=cfg.max_body_bytes,
        metrics=picker.metrics,
        budget=BodyBudget(limit=cfg.body_budget_bytes),
        body_timeout_s=cfg.body_timeout_s,
    )


async def _shutdown() -> None:
    await _state["app"].__aexit__(None, None, None)


async def _process(requests, emit) -> None:
    async for reply in _state["handler"].process(requests, _Context()):
        await emit((reply,))


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
)
