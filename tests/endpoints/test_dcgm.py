"""GPU utilization from a DCGM exporter page, polled over real HTTP into endpoint state."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from pathlib import Path

import pytest
from aiohttp import web

from extproc.core import Endpoint
from extproc.endpoints.dcgm import ATTRIBUTE, DCGMScraper, DCGMSettings, gpu_utilization
from extproc.endpoints.pool import EndpointPool
from extproc.endpoints.state import EndpointStates
from extproc.server.tls import self_signed

PAGE = b"""\
# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-1",pod="pod-a",namespace="ns"} 35
DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-2",pod="pod-a",namespace="ns"} 80
DCGM_FI_DEV_GPU_UTIL{gpu="2",UUID="GPU-3",pod="pod-b",namespace="ns"} 10
DCGM_FI_DEV_MEM_COPY_UTIL{gpu="0",pod="pod-a"} 99
"""


def test_the_pods_busiest_gpu_counts_as_a_fraction():
    assert gpu_utilization(PAGE, "pod-a") == 0.8
    assert gpu_utilization(PAGE, "pod-b") == 0.1
    assert gpu_utilization(PAGE, "") == 0.8  # no pod name: every sample counts
    assert gpu_utilization(PAGE, "pod-c") is None
    assert gpu_utilization(b"DCGM_FI_DEV_GPU_UTIL 12\n", "pod-c") == 0.12  # unlabelled: all
    assert gpu_utilization(b"nothing here\n", "pod-a") is None


async def test_poller_puts_the_attribute_in_state_and_removes_it_when_the_exporter_fails():
    pages = {"body": PAGE, "status": 200}

    async def handle(_: web.Request) -> web.Response:
        return web.Response(body=pages["body"], status=pages["status"])

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    states = EndpointStates()
    pool = EndpointPool(
        [Endpoint("127.0.0.1:8001", name="pod-a"), Endpoint("127.0.0.1:8002", name="pod-b")]
    )
    poller = DCGMScraper(pool, states, DCGMSettings(port=port, interval_s=0.02))
    task = asyncio.create_task(poller.run())
    try:

        async def until(check) -> None:
            for _ in range(250):
                if check():
                    return
                await asyncio.sleep(0.02)
            raise AssertionError("condition not reached")

        await until(lambda: ATTRIBUTE in states.state("127.0.0.1:8002").attributes)
        assert states.state("127.0.0.1:8001").attributes[ATTRIBUTE] == 0.8
        assert states.state("127.0.0.1:8002").attributes[ATTRIBUTE] == 0.1
        pages["status"] = 500
        await until(lambda: ATTRIBUTE not in states.state("127.0.0.1:8001").attributes)
        assert poller.stats.failures > 0
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await runner.cleanup()


async def _until(check, tries: int = 250) -> None:
    for _ in range(tries):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


@pytest.mark.parametrize("verify", ["off", "system CAs", "its CA file"])
async def test_https_polls_of_an_exporter_with_its_own_certificate(tmp_path: Path, verify: str):
    # The exporter serves a self-signed certificate, as DCGM exporters started with TLS do.
    # Polls do not verify by default (llm-d's insecureSkipVerify defaults to true); with
    # verification on, the system CAs refuse it and its own certificate file admits it.
    pair = self_signed()
    (tmp_path / "cert.pem").write_bytes(pair.cert_pem)
    (tmp_path / "key.pem").write_bytes(pair.key_pem)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")

    async def handle(_: web.Request) -> web.Response:
        return web.Response(body=PAGE)

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_ctx)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    states = EndpointStates()
    pool = EndpointPool([Endpoint("127.0.0.1:8001", name="pod-a")])
    settings = DCGMSettings(
        scheme="https",
        port=port,
        interval_s=0.02,
        tls_verify=verify != "off",
        tls_ca_file=str(tmp_path / "cert.pem") if verify == "its CA file" else None,
    )
    poller = DCGMScraper(pool, states, settings)
    task = asyncio.create_task(poller.run())
    try:
        if verify == "system CAs":
            await _until(lambda: poller.stats.failures >= 3)
            assert ATTRIBUTE not in states.state("127.0.0.1:8001").attributes
        else:
            await _until(lambda: ATTRIBUTE in states.state("127.0.0.1:8001").attributes)
            assert states.state("127.0.0.1:8001").attributes[ATTRIBUTE] == 0.8
            assert poller.stats.failures == 0
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await runner.cleanup()
