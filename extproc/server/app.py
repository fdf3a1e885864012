"""The process: builds the router from Settings, serves ext_proc and health, drains on stop.

`async with App(settings, endpoints) as app: await app.serve()`; `app.stop()` (what SIGTERM
calls) marks health NOT_SERVING, lets open streams finish within `grace_s`, then exits.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence

import grpc

from extproc import protocol
from extproc.config import Settings
from extproc.core import Endpoint
from extproc.endpoints import EndpointPool
from extproc.requests import parse_request
from extproc.router import Router
from extproc.scheduling import Scheduler
from extproc.scheduling.config import build_profiles, default_config
from extproc.scheduling.registry import PluginRegistry
from extproc.server import wire
from extproc.server.health import Health
from extproc.server.stream import StreamHandler

log = logging.getLogger("extproc.server")

# Keepalive so a proxy that vanished without closing its connection frees its streams.
_SERVER_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 8 * 1024 * 1024),
)


def build_router(settings: Settings, endpoints: Sequence[Endpoint]) -> Router:
    registry = PluginRegistry.default()
    profiles = build_profiles(settings.scheduling or default_config(), registry)
    return Router(
        pool=EndpointPool(endpoints),
        scheduler=Scheduler(profiles[0], fallbacks=settings.server.fallbacks),
        parser=functools.partial(parse_request, settings=settings.parse),
    )


class App:
    def __init__(self, settings: Settings, endpoints: Sequence[Endpoint]) -> None:
        self.settings = settings
        self.router = build_router(settings, endpoints)
        self.health = Health()
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self._stopped = asyncio.Event()
        self.port = 0
        self.health_port = 0

    async def __aenter__(self) -> App:
        cfg = self.settings.server
        handler = StreamHandler(self.router, max_body_bytes=cfg.max_body_bytes)
        # Registered by full method name: our message classes live in our own proto package
        # (see protos/), the service name is Envoy's.
        method = grpc.stream_stream_rpc_method_handler(
            handler.process,
            request_deserializer=wire.ProcessingRequest.FromString,
            response_serializer=wire.ProcessingResponse.SerializeToString,
        )
        generic = grpc.method_handlers_generic_handler(
            protocol.EXT_PROC_SERVICE, {"Process": method}
        )
        self._server = grpc.aio.server(options=_SERVER_OPTIONS)
        self._server.add_generic_rpc_handlers((generic,))
        self.health.add_to(self._server)
        self.port = self._server.add_insecure_port(f"{cfg.host}:{cfg.port}")
        self._health_server = grpc.aio.server()
        self.health.add_to(self._health_server)
        self.health_port = self._health_server.add_insecure_port(f"{cfg.host}:{cfg.health_port}")
        await self._health_server.start()
        await self._server.start()
        await self.health.set_ready(len(self.router.pool) > 0)
        log.info(
            "serving ext_proc",
            extra={
                "port": self.port,
                "health_port": self.health_port,
                "endpoints": len(self.router.pool),
            },
        )
        return self

    async def serve(self) -> None:
        """Run until `stop()` has drained the server."""
        await self._stopped.wait()

    async def stop(self) -> None:
        """Drain: NOT_SERVING first (so the proxy and Kubernetes stop sending), then let open
        streams finish for up to `grace_s`, then close."""
        if self._stopped.is_set():
            return
        await self.health.set_ready(False)
        if self._server is not None:
            await self._server.stop(self.settings.server.grace_s)
        if self._health_server is not None:
            await self._health_server.stop(0)
        self._stopped.set()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
