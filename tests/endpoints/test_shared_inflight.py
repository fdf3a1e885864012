"""Shared in-flight counts against a real redis-server: processes see each other's load, a
dead process's load expires, and a Redis outage degrades to local counts and heals."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import msgpack
import pytest
from redis.asyncio import Redis

from extproc.endpoints.inflight import InFlight
from extproc.endpoints.shared_inflight import SharedInFlight, SharedInFlightSettings
from tests.redis_servers import RedisServer, free_port

X, Y = "10.0.0.1:8000", "10.0.0.2:8000"
FAST = SharedInFlightSettings(interval_s=0.02, ttl_s=0.3, timeout_s=0.2, max_backoff_s=0.1)


@contextlib.asynccontextmanager
async def process(
    url: str, settings: SharedInFlightSettings = FAST, *, cluster: bool = False
) -> AsyncIterator[tuple[SharedInFlight, asyncio.Task[None]]]:
    """One picker process's shared counts with its exchange loop running."""
    shared = SharedInFlight.from_url(url, settings=settings, cluster=cluster)
    task = asyncio.create_task(shared.run())
    try:
        yield shared, task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await shared.aclose()


async def until(pred: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not pred():
            await asyncio.sleep(0.01)


async def test_local_counts_match_inflight_exactly_without_redis() -> None:
    """The hot path never needs Redis: with no loop running it is `InFlight`."""
    client = Redis(port=free_port())
    await client.aclose()
    shared = SharedInFlight(client, FAST)
    plain = InFlight()
    placements = []
    for address, tokens in [(X, 100), (X, 50), (Y, 7), (X, 1)]:
        placements.append((shared.acquire(address, tokens), plain.acquire(address, tokens)))
    shared.release(placements[1][0])
    plain.release(placements[1][1])
    for counts in (shared, plain):
        assert (counts.requests(X), counts.tokens(X), counts.requests(Y)) == (2, 101, 1)
        assert counts.total() == 3
    for s, p in placements[:1] + placements[2:]:
        shared.release(s)
        plain.release(p)
    assert shared.total() == plain.total() == 0 and shared.tokens(X) == 0


async def test_two_processes_see_each_others_load(redis_server: RedisServer) -> None:
    async with process(redis_server.url) as (a, _), process(redis_server.url) as (b, _):
        pa1 = a.acquire(X, 100)
        a.acquire(X, 100)
        b.acquire(X, 50)
        b.acquire(Y, 10)
        await until(lambda: a.requests(X) == 3 and b.requests(X) == 3 and a.requests(Y) == 1)
        assert a.tokens(X) == b.tokens(X) == 250 and a.tokens(Y) == 10
        assert a.total() == b.total() == 4
        assert a.local_total() == 2 and a.stats.peers == 1

        a.release(pa1)
        assert a.requests(X) == 2  # own counts change at once
        await until(lambda: b.requests(X) == 2)
        assert b.tokens(X) == 150


async def test_two_processes_share_load_on_a_redis_cluster(request: pytest.FixtureRequest) -> None:
    """Both keys carry one hash tag: the exchange script runs on one node of a Cluster."""
    url = request.getfixturevalue("redis_cluster").url
    async with (
        process(url, cluster=True) as (a, _),
        process(url, cluster=True) as (b, _),
    ):
        a.acquire(X, 30)
        b.acquire(X, 12)
        await until(lambda: a.requests(X) == b.requests(X) == 2)
        assert a.tokens(X) == b.tokens(X) == 42 and not a.is_degraded


async def test_a_crashed_process_load_vanishes_after_its_ttl(redis_server: RedisServer) -> None:
    crashed_client = Redis.from_url(redis_server.url)
    crashed = SharedInFlight(crashed_client, FAST)
    loop = asyncio.create_task(crashed.run())
    try:
        async with process(redis_server.url) as (b, _):
            crashed.acquire(X, 500)
            await until(lambda: b.requests(X) == 1)
            # A crash: the loop stops and nothing is withdrawn.
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop
            await asyncio.sleep(FAST.ttl_s / 3)  # type: ignore[operator]
            assert b.requests(X) == 1 and b.tokens(X) == 500  # still within its TTL
            await until(lambda: b.requests(X) == 0, timeout_s=3.0)
            assert b.tokens(X) == 0 and b.total() == 0 and b.stats.peers == 0
            assert await crashed_client.hlen("{extproc:inflight}:load") == 1  # only b
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        await crashed_client.aclose()


async def test_closing_withdraws_load_without_waiting_for_the_ttl(
    redis_server: RedisServer,
) -> None:
    slow_ttl = SharedInFlightSettings(interval_s=0.02, ttl_s=30.0)
    async with process(redis_server.url, slow_ttl) as (b, _):
        async with process(redis_server.url, slow_ttl) as (a, _):
            a.acquire(X, 1)
            await until(lambda: b.requests(X) == 1)
        await until(lambda: b.requests(X) == 0, timeout_s=2.0)


async def test_other_namespaces_and_foreign_entries_are_ignored(
    redis_server: RedisServer,
) -> None:
    other_pool = SharedInFlightSettings(interval_s=0.02, ttl_s=0.3, namespace="pool-b")
    async with (
        process(redis_server.url) as (a, _),
        process(redis_server.url, other_pool) as (c, _),
        Redis.from_url(redis_server.url) as raw,
    ):
        c.acquire(X, 1)
        await raw.zadd("{extproc:inflight}:live", {"stray": 2**50})
        await raw.hset("{extproc:inflight}:load", "stray", b"not msgpack \xc1")
        await raw.zadd("{extproc:inflight}:live", {"old": 2**50})
        await raw.hset("{extproc:inflight}:load", "old", msgpack.packb([1, 2]))
        await until(lambda: a.stats.bad_entries >= 2)
        assert a.requests(X) == 0


async def test_redis_outage_keeps_local_counts_then_heals(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="extproc.endpoints.shared_inflight")
    async with process(redis_server.url) as (a, ta), process(redis_server.url) as (b, tb):
        a.acquire(X, 100)
        b.acquire(Y, 10)
        await until(lambda: a.requests(Y) == 1 and b.requests(X) == 1)

        redis_server.kill()
        await until(lambda: a.is_degraded and b.is_degraded)
        # Own counts stay exact and usable; the peers' vanish once they would have expired.
        placed = a.acquire(X, 5)
        assert a.requests(X) == 2 and a.tokens(X) == 105
        a.release(placed)
        await until(lambda: b.requests(X) == 0 and a.requests(Y) == 0)
        assert a.requests(X) == 1 and b.requests(Y) == 1
        errors = a.stats.errors
        await until(lambda: a.stats.errors > errors + 2)
        assert not ta.done() and not tb.done()

        redis_server.start()
        await until(lambda: a.requests(Y) == 1 and b.requests(X) == 1)
        assert not a.is_degraded and not b.is_degraded

    messages = [r.getMessage() for r in caplog.records]
    assert sum("exchange failed" in m for m in messages) == 2  # once per process
    assert sum("back after" in m for m in messages) == 2


async def test_peers_tokens_arrive_dated_and_are_forgotten_with_their_counts(
    redis_server: RedisServer,
) -> None:
    """What `predicted-ttft-scorer`'s `peerInflight: drained` reads: each process's view of
    the others' tokens as arrivals dated by the exchange that brought them (its own never
    among them); they drain at a lane's speed, leave with a release, and go when Redis does."""
    async with process(redis_server.url) as (a, _), process(redis_server.url) as (b, _):
        placed = b.acquire(X, 3000)
        a.acquire(X, 700)  # a's own: in its counts, not among its peers' arrivals
        await until(lambda: a.arrivals.total(X) == 3000 and b.arrivals.total(X) == 700)
        now = asyncio.get_running_loop().time()
        assert a.tokens(X) == 3700
        assert 2900 < a.arrivals.pending(X, now, tps=1000.0) <= 3000  # seen ~an interval ago
        assert a.arrivals.pending(X, now + 3.5, tps=1000.0) == 0.0  # computed by then
        # `sharedLane`: a's own 700, published no later than b's 3,000 reached a, are ahead
        # of them in the lane: at 3 s past, a peers-only lane is done, the shared one not.
        assert a.arrivals.pending(X, now + 3.0, tps=1000.0) == 0.0
        assert 500 < a.arrivals.pending_shared(X, now + 3.0, tps=1000.0) <= 700
        # b's own 3,000 were published before a's 700 reached b: those wait behind them.
        assert b.arrivals.pending(X, now + 1.0, tps=1000.0) == 0.0
        assert b.arrivals.pending_shared(X, now + 1.0, tps=1000.0) == 700.0
        b.release(placed)
        await until(lambda: a.arrivals.total(X) == 0)
        assert a.arrivals.pending(X, now, tps=1.0) == 0.0
        b.acquire(Y, 50)
        await until(lambda: a.arrivals.total(Y) == 50)
        redis_server.kill()
        # The peers' counts expire as Redis would have expired them; their arrivals too.
        await until(lambda: a.requests(Y) == 0)
        assert a.arrivals.total(Y) == 0 and a.arrivals.pending(Y, now, tps=1.0) == 0.0
