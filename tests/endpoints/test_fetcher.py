"""MetricsFetcher against real servers: aiohttp answers (sized, chunked), and raw sockets for
the shapes aiohttp will not produce (close-delimited, truncated, over-long, encoded)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

from extproc.endpoints.fetcher import FetchError, MetricsFetcher

BODY = (Path(__file__).parents[1] / "fixtures" / "vllm-0.32-cpu" / "metrics.txt").read_bytes()


@contextlib.asynccontextmanager
async def aiohttp_server(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[tuple[str, list[tuple[str, int]]]]:
    """Yields the address and the list of client (host, port) peers seen per request."""
    peers: list[tuple[str, int]] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername")[:2])  # type: ignore[union-attr]
        return await handler(request)

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, shutdown_timeout=0.2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"127.0.0.1:{port}", peers
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def raw_server(answer: bytes, *, close: bool) -> AsyncIterator[str]:
    """Answers every request on a connection with `answer` (and closes if `close`)."""

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while await reader.readuntil(b"\r\n\r\n"):
                writer.write(answer)
                await writer.drain()
                if close:
                    break
        with contextlib.suppress(ConnectionError):
            writer.close()

    server = await asyncio.start_server(client, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.close()


async def fetch(address: str, **kw: object) -> bytes:
    f = MetricsFetcher(address, **kw)  # type: ignore[arg-type]
    try:
        async with asyncio.timeout(5):
            return await f.fetch()
    finally:
        f.close()


async def test_sized_answers_reuse_one_connection() -> None:
    async def ok(_: web.Request) -> web.Response:
        return web.Response(body=BODY, content_type="text/plain")

    async with aiohttp_server(ok) as (address, peers):
        f = MetricsFetcher(address)
        for _ in range(5):
            async with asyncio.timeout(5):
                assert await f.fetch() == BODY
        f.close()
    assert f.connects == 1
    assert len(set(peers)) == 1 and len(peers) == 5


async def test_chunked_answer_is_decoded() -> None:
    async def chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(0, len(BODY), 7000):
            await resp.write(BODY[i : i + 7000])
        await resp.write_eof()
        return resp

    async with aiohttp_server(chunked) as (address, _):
        f = MetricsFetcher(address)
        for _ in range(3):  # the connection stays usable after a chunked answer
            async with asyncio.timeout(5):
                assert await f.fetch() == BODY
        f.close()
        assert f.connects == 1


async def test_close_delimited_answer_ends_at_close_and_reconnects() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n" + BODY
    async with raw_server(answer, close=True) as address:
        f = MetricsFetcher(address)
        for _ in range(2):
            async with asyncio.timeout(5):
                assert await f.fetch() == BODY
        f.close()
        assert f.connects == 2


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\ndead", "HTTP 500"),
        (b"HTTP/1.1 302 Found\r\nLocation: /x\r\nContent-Length: 0\r\n\r\n", "HTTP 302"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 99999999\r\n\r\n", "body of 99999999 bytes"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort", "closed before"),
        (b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 2\r\n\r\nxx", "encoding"),
        (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", "not an HTTP/1.x answer"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
    ],
)
async def test_unusable_answers_fail_clearly(answer: bytes, error: str) -> None:
    async with raw_server(answer, close=True) as address:
        with pytest.raises(FetchError, match=error):
            await fetch(address, max_body_bytes=1 << 20)


async def test_bodies_over_the_limit_fail_while_streaming() -> None:
    async def chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for _ in range(100):
            await resp.write(b"x" * 10_000)
        await resp.write_eof()
        return resp

    async with aiohttp_server(chunked) as (address, _):
        with pytest.raises(FetchError, match="over 100000 bytes"):
            await fetch(address, max_body_bytes=100_000)


async def test_a_cancelled_fetch_drops_its_connection() -> None:
    release = asyncio.Event()

    async def slow_once(_: web.Request) -> web.Response:
        if not release.is_set():
            release.set()
            await asyncio.sleep(10)
        return web.Response(body=BODY, content_type="text/plain")

    async with aiohttp_server(slow_once) as (address, _):
        f = MetricsFetcher(address)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await f.fetch()
        async with asyncio.timeout(5):
            assert await f.fetch() == BODY  # a fresh connection, not the stale answer
        f.close()
        assert f.connects == 2


def test_works_on_uvloop_the_servers_event_loop() -> None:
    """`extproc serve` runs on uvloop, whose transports are not asyncio's classes."""
    import uvloop

    async def main() -> tuple[bytes, int]:
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY
        async with raw_server(answer, close=False) as address:
            f = MetricsFetcher(address)
            for _ in range(3):
                async with asyncio.timeout(5):
                    body = await f.fetch()
            f.close()
            return body, f.connects

    body, connects = uvloop.run(main())
    assert body == BODY and connects == 1
