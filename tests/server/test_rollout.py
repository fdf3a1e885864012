"""Graceful rollout: readiness turns SERVING only once endpoints are known, and SIGTERM
drains: NOT_SERVING at once, new streams refused, the open stream completes, Envoy's
access-log stream is answered once it has, exit 0 well within the grace."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import msgspec
import orjson
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc._proto.extproc.wire.v1 import access_log_pb2
from extproc.server.access_log import SERVICE as ACCESS_LOG_SERVICE
from extproc.server.app import App
from extproc.server.health import NOT_SERVING, SERVING
from extproc.stack import free_port, grpc_health_status, wait_until
from extproc.testing import ExtProcClient, body_chunks, destination, post, request_headers
from tests.conftest import ENDPOINTS
from tests.endpoints.fakekube import pool_discovery

CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


async def status(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return (await stub.Check(health_pb2.HealthCheckRequest(service=service))).status


async def test_not_ready_for_any_probe_name_until_discovery_has_synced(settings, tmp_path):
    """An API server that cannot be reached: the pool stays unknown, so every name a proxy or
    kubelet probes for readiness answers NOT_SERVING (liveness stays SERVING)."""
    unreachable = f"http://127.0.0.1:{free_port()}"
    s = msgspec.structs.replace(
        settings, endpoints=[], discovery=pool_discovery(tmp_path, unreachable)
    )
    async with App(s, []) as app:
        await asyncio.sleep(0.3)  # a few failed list attempts
        for service in ("", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert await status(app.health_port, service) == NOT_SERVING, service
            assert await status(app.port, service) == NOT_SERVING, service
        assert await status(app.health_port, "liveness") == SERVING


@pytest.fixture
def picker(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, int]]:
    port, health = free_port(), free_port()
    config = tmp_path / "picker.yaml"
    config.write_text(yaml.safe_dump({"server": {"grace_s": 20, "drain_delay_s": 1.0}}))
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "extproc", "serve", "--plaintext", "--config", str(config)),
            *("--endpoints", ",".join(ENDPOINTS), "--host", "127.0.0.1", "--admin-port", "0"),
            *("--port", str(port), "--health-port", str(health)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(
            lambda: grpc_health_status(health, "readiness") == SERVING,
            timeout_s=30,
            what="extproc",
            proc=proc,
        )
        yield proc, port, health
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


async def test_sigterm_lets_the_open_stream_finish_and_refuses_new_ones(picker):
    proc, port, health = picker
    async with (
        ExtProcClient(f"127.0.0.1:{port}") as client,
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        # Envoy's access-log stream: open for as long as its connection, it never ends by
        # itself, so the drain must end it or wait the whole grace (20 s here).
        access_log = channel.stream_unary(
            f"/{ACCESS_LOG_SERVICE}/StreamAccessLogs",
            request_serializer=access_log_pb2.StreamAccessLogsMessage.SerializeToString,
            response_deserializer=access_log_pb2.StreamAccessLogsResponse.FromString,
        )()
        await access_log.write(access_log_pb2.StreamAccessLogsMessage())
        call = client.open()
        # FULL_DUPLEX: the picker holds its header reply until the body ends, so the
        # stream stays open across the SIGTERM.
        await call.write(request_headers(post("/v1/chat/completions")))
        await asyncio.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        await _until(lambda: status(health, "readiness"), NOT_SERVING)

        # For drain_delay_s after NOT_SERVING, new streams are still served: the proxy's
        # health checks need that long to stop sending, and nothing sent meanwhile is lost.
        served = await client.exchange(
            [request_headers(post("/v1/chat/completions")), *body_chunks(CHAT)]
        )
        assert destination(served[0]) in ENDPOINTS

        async def refused() -> int:
            try:
                await client.exchange([request_headers(post("/v1/chat/completions"))])
            except grpc.aio.AioRpcError as exc:
                return exc.code().value[0]
            return -1

        await _until(refused, grpc.StatusCode.UNAVAILABLE.value[0])
        assert proc.poll() is None  # still draining: the open stream holds it
        # Entries still arrive while a request is being served.
        await access_log.write(access_log_pb2.StreamAccessLogsMessage())
        assert not access_log.done()

        for m in body_chunks(CHAT):
            await call.write(m)
        await call.done_writing()
        responses = [r async for r in call]
        assert destination(responses[0]) in ENDPOINTS
        finished = time.monotonic()
        await asyncio.wait_for(access_log, 10)  # answered, OK, without our half-close
    assert await asyncio.to_thread(proc.wait, 20) == 0
    assert time.monotonic() - finished < 10, "the access-log stream held the drain"


async def _until(check, want: int, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            if await check() == want:
                return
        except grpc.aio.AioRpcError:
            pass
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.05)
