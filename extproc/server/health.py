"""gRPC health: the standard service, answering for every name the proxy and Kubernetes
probe (`""`, `liveness`, `readiness`, the ext_proc service name)."""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc import protocol

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    """Liveness stays SERVING while the process runs; readiness and the service names flip
    with `set_ready` (ready once endpoints and config are loaded, not ready while draining)."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()

    async def set_ready(self, ready: bool) -> None:
        status = SERVING if ready else NOT_SERVING
        await self.servicer.set("liveness", SERVING)
        for name in protocol.HEALTH_SERVICES:
            if name != "liveness":
                await self.servicer.set(name, status)

    def add_to(self, server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
