"""The scrape loop against real HTTP servers that answer well, slowly, with 500 or with
garbage (reading the bodies is tests/endpoints/test_exposition.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest
from aiohttp import web

from extproc.core import Endpoint
from extproc.endpoints import scrape
from extproc.endpoints.pool import EndpointPool
from extproc.endpoints.scrape import MetricsScraper, ScrapeSettings
from extproc.endpoints.state import EndpointStates
from tests.index.conftest import ManualClock

FIXTURE = Path(__file__).parents[1] / "fixtures" / "vllm-0.32-cpu" / "metrics.txt"
VLLM = FIXTURE.read_bytes()


# -- the scrape loop against real HTTP servers -----------------------------------------------


class ModelServer:
    """A real aiohttp server on a free loopback port whose answer a test switches."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.body = VLLM
        self.hits = 0
        self.slow_left = 0  # answers still to delay past any timeout, then normal again
        self.release = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.address = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        slow_once = self.slow_left > 0
        self.slow_left -= slow_once
        if self.mode == "slow" or slow_once:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await self.release.wait()
        if self.mode == "error":
            return web.Response(status=500, text="engine dead")
        if self.mode == "garbage":
            return web.Response(body=b"<html>hello</html>", content_type="text/html")
        return web.Response(body=self.body, content_type="text/plain")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self.handle)
        self.runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.address = f"127.0.0.1:{port}"

    async def stop(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def servers() -> AsyncIterator[dict[str, ModelServer]]:
    out = {m: ModelServer(m) for m in ("ok", "slow", "error", "garbage")}
    for s in out.values():
        await s.start()
    try:
        yield out
    finally:
        for s in out.values():
            await s.stop()


@contextlib.asynccontextmanager
async def running(scraper: MetricsScraper) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(scraper.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def until(pred: Callable[[], bool], timeout_s: float = 15.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not pred():
            await asyncio.sleep(0.01)


# A timeout with the margin a loaded 2-core CI machine needs (a stalled first connect must
# not read as a failing endpoint); the slow endpoint still times out quickly enough.
FAST = ScrapeSettings(interval_s=0.02, timeout_s=0.5, max_backoff_s=0.04)


async def test_loop_survives_slow_failing_and_garbage_endpoints(
    servers: dict[str, ModelServer], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="extproc.endpoints.scrape")
    pool = EndpointPool(Endpoint(s.address) for s in servers.values())
    states = EndpointStates(stale_after_s=FAST.stale_after_s)
    scraper = MetricsScraper(pool, states, FAST)
    ok, bad = servers["ok"].address, [servers[m].address for m in ("slow", "error", "garbage")]
    async with running(scraper) as task:
        await until(lambda: all(scraper.failures(a) >= 3 for a in bad))
        await until(lambda: scraper.stats.scrapes >= 10)
        assert not task.done()

    assert states.state(ok).kv_blocks == 65536
    assert not scraper.is_failing(ok) and scraper.failures(ok) == 0
    for a in bad:
        assert scraper.is_failing(a)
        assert a not in states and states.is_stale(a) and states.state(a).age_s is None
    assert scraper.stats.failures >= 9
    # A slow endpoint never held up the others: the healthy one kept its pace meanwhile.
    assert servers["ok"].hits >= 10
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert sorted(r.args[0] for r in warned) == sorted(bad)  # type: ignore[index]


async def test_endpoint_that_starts_failing_goes_stale_and_recovers(
    servers: dict[str, ModelServer], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="extproc.endpoints.scrape")
    clock = ManualClock()
    server = servers["ok"]
    address = server.address
    pool = EndpointPool([Endpoint(address)])
    states = EndpointStates(stale_after_s=0.2, clock=clock)
    scraper = MetricsScraper(pool, states, FAST, clock=clock)
    async with running(scraper):
        await until(lambda: address in states)
        assert states.state(address).age_s == 0.0 and not states.is_stale(address)

        server.mode = "error"
        await until(lambda: scraper.is_failing(address))
        clock.advance(0.3)
        assert states.is_stale(address)
        assert states.state(address).age_s == pytest.approx(0.3)
        assert states.state(address).kv_blocks == 65536  # old figures kept, marked by age

        server.mode = "ok"
        server.body = VLLM.replace(
            b'vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0',
            b'vllm:num_requests_waiting{engine="0",model_name="tiny"} 9.0',
        )
        await until(lambda: states.state(address).waiting == 9)
        assert not states.is_stale(address) and not scraper.is_failing(address)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("failing" in m for m in messages) == 1
    assert sum("back after" in m for m in messages) == 1
    assert any(m.endswith("0.3 s stale") for m in messages), messages  # and how long


async def test_unchanged_bodies_are_not_parsed_again_and_changes_are_seen(
    servers: dict[str, ModelServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle engine's body repeats: it is hashed, not parsed, and still refreshes the
    endpoint's age; a changed body is parsed. One kept-alive connection throughout."""
    parsed = [0]
    real = scrape.parse_metrics

    def counting(body: bytes):  # type: ignore[no-untyped-def]
        parsed[0] += 1
        return real(body)

    monkeypatch.setattr(scrape, "parse_metrics", counting)
    clock = ManualClock()
    server = servers["ok"]
    address = server.address
    states = EndpointStates(stale_after_s=0.2, clock=clock)
    scraper = MetricsScraper(EndpointPool([Endpoint(address)]), states, FAST)
    async with running(scraper):
        await until(lambda: scraper.stats.scrapes >= 5)
        assert parsed[0] == 1
        assert scraper.stats.unchanged == scraper.stats.scrapes - 1
        clock.advance(0.3)
        assert states.is_stale(address)
        await until(lambda: not states.is_stale(address))  # an unchanged body refreshes

        server.body = VLLM.replace(
            b'vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0',
            b'vllm:num_requests_waiting{engine="0",model_name="tiny"} 4.0',
        )
        await until(lambda: states.state(address).waiting == 4)
        assert parsed[0] == 2
    assert scraper.stats.connects == 1
    assert scraper.stats.parse_cpu_s > 0


async def test_endpoints_leaving_the_pool_are_dropped(servers: dict[str, ModelServer]) -> None:
    first, second = servers["ok"], ModelServer("ok")
    await second.start()
    try:
        pool = EndpointPool([Endpoint(first.address), Endpoint(second.address)])
        states = EndpointStates()
        scraper = MetricsScraper(pool, states, FAST)
        async with running(scraper):
            await until(lambda: len(states) == 2)
            pool.replace([Endpoint(second.address)])
            await until(lambda: first.address not in states)
            hits = second.hits
            await until(lambda: second.hits > hits + 2)
            assert first.address not in states and second.address in states
    finally:
        await second.stop()


START = b"process_start_time_seconds 1.79597100344e+09"


async def test_restart_or_failure_invalidates_the_endpoint_within_one_interval(
    servers: dict[str, ModelServer],
) -> None:
    """A new process start time (a restarted engine: empty cache) and a failed scrape (dead or
    restarting) each call `on_invalidate` once, and are counted by reason."""
    server = servers["ok"]
    address = server.address
    calls: list[tuple[str, str]] = []

    async def invalidate(a: str, reason: str) -> None:
        calls.append((a, reason))

    states = EndpointStates(stale_after_s=FAST.stale_after_s)
    scraper = MetricsScraper(
        EndpointPool([Endpoint(address)]), states, FAST, on_invalidate=invalidate
    )
    async with running(scraper):
        await until(lambda: scraper.stats.scrapes >= 3)
        assert calls == []  # a steady start time is the same process
        server.body = VLLM.replace(START, b"process_start_time_seconds 1.79597200000e+09")
        await until(lambda: bool(calls))
        assert calls == [(address, "restart")]
        hits = server.hits
        await until(lambda: server.hits >= hits + 3)
        assert calls == [(address, "restart")]  # once per change
        server.mode = "error"
        await until(lambda: len(calls) == 2)
        await until(lambda: scraper.failures(address) >= 3)
        assert calls[1] == (address, "unreachable") and len(calls) == 2  # once per outage
    assert scraper.stats.invalidations == {"restart": 1, "unreachable": 1}


async def test_a_busy_server_timing_out_twice_is_neither_excluded_nor_forgotten(
    servers: dict[str, ModelServer],
) -> None:
    """Timeouts are a busy server (a long prefill), not a dead one: only the third in a row
    makes it failing; a refused or wrong answer does at once (the tests above). Even then
    its cache is kept while its start time says it is the same process: a frozen or starved
    server that answers again has lost nothing; a new start time, or a hard failure, is what
    forgets it."""
    server = servers["ok"]
    address = server.address
    calls: list[tuple[str, str]] = []

    async def invalidate(a: str, reason: str) -> None:
        calls.append((a, reason))

    # A timeout no healthy answer misses on a loaded machine: only the delayed ones fail.
    settings = msgspec.structs.replace(FAST, timeout_s=0.6)
    states = EndpointStates(stale_after_s=settings.stale_after_s)
    scraper = MetricsScraper(
        EndpointPool([Endpoint(address)]), states, settings, on_invalidate=invalidate
    )
    async with running(scraper):
        await until(lambda: scraper.stats.scrapes >= 1)
        server.slow_left = 2
        await until(lambda: scraper.failures(address) >= 2)
        assert not scraper.is_failing(address)
        scrapes = scraper.stats.scrapes
        await until(lambda: scraper.stats.scrapes > scrapes)
        assert not scraper.is_failing(address) and scraper.failures(address) == 2
        server.mode = "slow"
        await until(lambda: scraper.failures(address) >= 5)
        assert scraper.is_failing(address)
        assert calls == []  # out of routing, cache kept: the same process, only slow
        server.mode = "ok"
        server.release.set()
        await until(lambda: not scraper.is_failing(address))
        assert calls == []  # back with the same start time: nothing was lost
        server.release.clear()
        server.mode = "slow"
        failures = scraper.failures(address)
        await until(lambda: scraper.failures(address) >= failures + 3)
        server.mode = "error"  # then it dies: that loses the cache
        server.release.set()
        await until(lambda: bool(calls))
        assert calls == [(address, "unreachable")]


async def test_a_failing_invalidation_shows_on_metrics(caplog: pytest.LogCaptureFixture) -> None:
    """The scrape loop outlives an index that raises while dropping an endpoint's blocks,
    but the miss is counted (the index may still credit a cache that is gone), not only
    logged."""
    from extproc.server.families import SCRAPE

    async def invalidate(address: str, reason: str) -> None:
        raise RuntimeError("index down")

    scraper = MetricsScraper(
        EndpointPool([Endpoint("10.0.0.1:8000")]),
        EndpointStates(stale_after_s=FAST.stale_after_s),
        FAST,
        on_invalidate=invalidate,
    )
    await scraper._invalidate("10.0.0.1:8000", "restart")
    fam = next(
        f for f in SCRAPE.families(scraper.stats)
        if f.name == "extproc_endpoint_cache_invalidation_failures"
    )  # fmt: skip
    assert [s.value for s in fam.samples] == [1]
    assert scraper.stats.invalidations == {"restart": 1}
    assert any("invalidating its cached blocks failed" in r.getMessage() for r in caplog.records)
