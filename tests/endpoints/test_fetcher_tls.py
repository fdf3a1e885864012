"""https scrapes: MetricsFetcher and the scrape loop against a real TLS server (aiohttp on a
loopback port, a self-signed certificate made for the test), the way a model server started
with its own certificate answers."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from extproc.core import Endpoint
from extproc.endpoints.fetcher import FetchError, MetricsFetcher
from extproc.endpoints.pool import EndpointPool
from extproc.endpoints.scrape import MetricsScraper, ScrapeSettings
from extproc.endpoints.state import EndpointStates
from extproc.server.tls import self_signed

BODY = (Path(__file__).parents[1] / "fixtures" / "vllm-0.32-cpu" / "metrics.txt").read_bytes()


@pytest.fixture(scope="module")
def cert_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    pair = self_signed()
    d = tmp_path_factory.mktemp("tls")
    (d / "key.pem").write_bytes(pair.key_pem)
    (d / "cert.pem").write_bytes(pair.cert_pem)
    return str(d / "cert.pem"), str(d / "key.pem")


@contextlib.asynccontextmanager
async def tls_server(
    cert_files: tuple[str, str], *, chunked: bool = False
) -> AsyncIterator[tuple[str, list[tuple[str, int]]]]:
    """A metrics server speaking only TLS; yields its address and the client peers seen."""
    peers: list[tuple[str, int]] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername")[:2])  # type: ignore[union-attr]
        if not chunked:
            return web.Response(body=BODY, content_type="text/plain")
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(0, len(BODY), 7000):  # chunks that straddle TLS records
            await resp.write(BODY[i : i + 7000])
        await resp.write_eof()
        return resp

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(*cert_files)
    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, shutdown_timeout=0.2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"127.0.0.1:{port}", peers
    finally:
        await runner.cleanup()


async def fetch_n(f: MetricsFetcher, n: int) -> list[bytes]:
    try:
        out = []
        for _ in range(n):
            async with asyncio.timeout(10):  # a loaded machine's TLS handshake, with margin
                out.append(await f.fetch())
        return out
    finally:
        f.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["sized", "chunked"])
async def test_https_answers_reuse_one_tls_connection(
    cert_files: tuple[str, str], chunked: bool
) -> None:
    """The default (llm-d's insecureSkipVerify: true) reads a self-signed server; every
    fetch after the first rides the same TLS connection."""
    async with tls_server(cert_files, chunked=chunked) as (address, peers):
        f = MetricsFetcher(address, scheme="https")
        bodies = await fetch_n(f, 5)
    assert bodies == [BODY] * 5
    assert f.connects == 1
    assert len(set(peers)) == 1 and len(peers) == 5


async def test_verification_refuses_an_unknown_certificate_and_accepts_its_ca(
    cert_files: tuple[str, str],
) -> None:
    async with tls_server(cert_files) as (address, _):
        with pytest.raises(ssl.SSLCertVerificationError):
            await fetch_n(MetricsFetcher(address, scheme="https", tls_verify=True), 1)
        pinned = MetricsFetcher(address, scheme="https", tls_verify=True, tls_ca_file=cert_files[0])
        assert await fetch_n(pinned, 2) == [BODY] * 2


async def test_scheme_mismatches_fail_fast(cert_files: tuple[str, str]) -> None:
    """Plain HTTP to a TLS port, and TLS to a plain port: an error within the timeout, never
    a body or a hang."""
    async with tls_server(cert_files) as (address, _):
        with pytest.raises((FetchError, ConnectionError)):
            await fetch_n(MetricsFetcher(address), 1)

    async def plain(_: web.Request) -> web.Response:
        return web.Response(body=BODY, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", plain)
    runner = web.AppRunner(app, shutdown_timeout=0.2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        with pytest.raises((ssl.SSLError, ConnectionError, FetchError)):
            await fetch_n(MetricsFetcher(f"127.0.0.1:{port}", scheme="https"), 1)
    finally:
        await runner.cleanup()


async def test_scrape_loop_over_https(cert_files: tuple[str, str]) -> None:
    """`state.scrape.scheme: https`: the loop reads the engine's figures over one kept TLS
    connection per endpoint."""
    settings = ScrapeSettings(scheme="https", interval_s=0.02, timeout_s=2.0, max_backoff_s=0.04)
    async with tls_server(cert_files) as (address, peers):
        states = EndpointStates(stale_after_s=settings.stale_after_s)
        scraper = MetricsScraper(EndpointPool([Endpoint(address)]), states, settings)
        task = asyncio.create_task(scraper.run())
        try:
            async with asyncio.timeout(20):
                while scraper.stats.scrapes < 5:
                    await asyncio.sleep(0.01)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert states.state(address).kv_blocks == 65536
    assert scraper.stats.failures == 0
    assert scraper.stats.connects == 1 and len(set(peers)) == 1
