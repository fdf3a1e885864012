"""Placements pushed to the peers at decision time (endpoints/inflight_push.py): a peer counts
one within a round trip, not at the exchange; the exchange never counts it twice, in either
order; forged pushes are bounded and expire; Redis down is logged, shown and counted."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import msgpack
import msgspec
import pytest
from redis.asyncio import Redis

from extproc.config import IndexSettings, Settings, StateSettings
from extproc.endpoints import parse_endpoints
from extproc.endpoints.inflight_push import InFlightPush
from extproc.endpoints.shared_inflight import SharedInFlight, SharedInFlightSettings
from extproc.redis_broadcast import Broadcast
from extproc.server.app import App
from tests.redis_servers import RedisServer, free_port
from tests.server.broadcasting import until

X, Y = "10.0.0.1:8000", "10.0.0.2:8000"
# An exchange far slower than a push: what a peer sees within 0.15 s came by the push.
SLOW = SharedInFlightSettings(interval_s=0.4, ttl_s=3.0, timeout_s=0.5, max_backoff_s=0.2)
TTL = 0.3
FAST = SharedInFlightSettings(interval_s=0.05, ttl_s=TTL, timeout_s=0.2, max_backoff_s=0.1)


@contextlib.asynccontextmanager
async def replica(
    url: str, settings: SharedInFlightSettings, *, push: bool = True
) -> AsyncIterator[tuple[SharedInFlight, InFlightPush | None]]:
    """One replica's shared counts with its exchange (and push) loops running."""
    shared = SharedInFlight.from_url(url, settings=settings)
    pusher = InFlightPush.from_url(url, shared, known=lambda a: a in (X, Y)) if push else None
    tasks = [asyncio.create_task(shared.run())]
    if pusher is not None:
        tasks.append(asyncio.create_task(pusher.run()))
    try:
        yield shared, pusher
    finally:
        for t in tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if pusher is not None:
            await pusher.aclose()
        await shared.aclose()


async def _seen_within(a: SharedInFlight, b: SharedInFlight, seconds: float) -> bool:
    """Whether `b` counts `a`'s placement on X, made right after `b`'s exchange, within
    `seconds` (`b`'s next exchange is an interval away)."""
    exchanges = b.stats.exchanges
    await until(lambda: b.stats.exchanges > exchanges, "an exchange")
    before = b.requests(X)
    a.acquire(X, 300)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            while b.requests(X) == before:
                await asyncio.sleep(0.005)
    return b.requests(X) > before


async def test_a_peer_counts_a_placement_at_once_and_the_exchange_not_twice(
    redis_server: RedisServer,
) -> None:
    async with (
        replica(redis_server.url, SLOW) as (a, _),
        replica(redis_server.url, SLOW) as (b, _),
    ):
        await until(lambda: a.peers() and b.peers(), "the replicas know each other")
        await _subscribed(redis_server.url, f"{b.namespace}:push", 2)
        assert await _seen_within(a, b, 0.15)
        exchanges = b.stats.exchanges
        assert (b.tokens(X), b.arrivals.total(X), b.stats.pushed_arrivals) == (300, 300, 1)
        # The exchange that shows it adds nothing: one arrival, 300 tokens, counted once.
        await until(lambda: b.stats.exchanges >= exchanges + 2, "two more exchanges")
        assert (b.requests(X), b.tokens(X), b.arrivals.total(X)) == (1, 300, 300)
        assert b.stats.peer_arrived_tokens == 300
        assert round(b.arrivals.pending(X, time.monotonic(), 1e-9)) == 300  # once, not twice


async def test_without_push_the_exchange_alone_is_late(redis_server: RedisServer) -> None:
    """The control: the same placement is not seen within 0.15 s by the exchange alone."""
    async with (
        replica(redis_server.url, SLOW, push=False) as (a, _),
        replica(redis_server.url, SLOW, push=False) as (b, _),
    ):
        await until(lambda: a.peers() and b.peers(), "the replicas know each other")
        assert not await _seen_within(a, b, 0.15)


async def _subscribed(url: str, channel: str, n: int) -> None:
    """Waits for `n` subscribers on `channel` (pub/sub keeps nothing for a late one)."""
    client = Redis.from_url(url)
    try:
        async with asyncio.timeout(5):
            while (await client.pubsub_numsub(channel))[0][1] < n:
                await asyncio.sleep(0.01)
    finally:
        await client.aclose()


def _entry(peer: str, load: dict, counters: dict) -> list[bytes]:
    return [peer.encode(), msgpack.packb(load) if load else b"", msgpack.packb(counters)]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _alone(clock: Clock) -> SharedInFlight:
    """A replica whose exchanges are fed by hand (`_merge`): no Redis."""
    return SharedInFlight(Redis(port=free_port()), FAST, process_id="me", clock=clock)


def test_pushes_and_exchanges_in_any_order_count_each_placement_once() -> None:
    clock = Clock()
    me = _alone(clock)
    me._merge(_entry("p", {X: [1, 100]}, {X: [2, 200]}))
    assert (me.requests(X), me.tokens(X), me.arrivals.total(X)) == (1, 100, 100)

    me.pushed("p", X, 3, 350, 0.0)  # its third placement, 150 tokens
    assert (me.requests(X), me.tokens(X), me.arrivals.total(X)) == (2, 250, 250)
    me.pushed("p", X, 3, 350, 0.0)  # a duplicate
    assert me.tokens(X) == 250 and me.stats.push_late == 1

    # Its exchange entry, written before that placement: the push still counts on top.
    clock.t += 0.05
    me._merge(_entry("p", {X: [1, 100]}, {X: [2, 200]}))
    assert (me.requests(X), me.tokens(X), me.arrivals.total(X)) == (2, 250, 250)

    # Now the entry shows it, and one more placement (50) and one end (the first, 100).
    clock.t += 0.05
    me._merge(_entry("p", {X: [2, 200]}, {X: [4, 400]}))
    assert (me.requests(X), me.tokens(X), me.arrivals.total(X)) == (2, 200, 200)
    # Arrived: 100 (first seen), 150 (pushed), 50 (the exchange): never the 150 twice.
    assert me.stats.peer_arrived_tokens == 300 and me.stats.pushed_tokens == 150
    # A push the exchange showed already adds nothing.
    me.pushed("p", X, 4, 400, 0.0)
    assert me.tokens(X) == 200 and me.stats.push_late == 2
    assert me.stats.push_unconfirmed == 0


def test_forged_pushes_are_refused_or_expire() -> None:
    clock = Clock()
    me = _alone(clock)
    me._merge(_entry("p", {}, {X: [2, 200]}))
    me.pushed("stranger", X, 1, 100, 0.0)  # not in the exchange
    me.pushed("p", X, 2 + 65, 300, 0.0)  # more requests at once than a push can hold
    me.pushed("p", X, 3, 150, 0.0)  # tokens going back
    me.pushed("p", X, 3, 200 + (1 << 24), 0.0)  # a prompt past any context window
    assert me.stats.push_refused == 4 and me.tokens(X) == 0 and me.total() == 0

    # Plausible but never confirmed by an exchange: counted for the TTL only.
    me.pushed("p", X, 3, 10_000, 5.0)  # a claimed age beyond an interval is one interval
    assert (me.requests(X), me.tokens(X), me.arrivals.total(X)) == (1, 9_800, 9_800)
    clock.t += TTL / 2
    me._merge(_entry("p", {}, {X: [2, 200]}))
    assert me.tokens(X) == 9_800
    clock.t += TTL
    me._merge(_entry("p", {}, {X: [2, 200]}))
    assert (me.requests(X), me.tokens(X), me.arrivals.total(X)) == (0, 0, 0)
    assert me.stats.push_unconfirmed == 1
    # Gone from the exchange: its pushes are refused and nothing of it is kept.
    me._merge([])
    me.pushed("p", X, 5, 500, 0.0)
    assert me.stats.push_refused == 5 and me.total() == 0 and not me._pushed


async def test_bad_items_on_the_channel_are_counted_and_skipped(
    redis_server: RedisServer,
) -> None:
    async with replica(redis_server.url, SLOW) as (b, pusher):
        assert pusher is not None
        await _subscribed(redis_server.url, f"{b.namespace}:push", 1)
        client = Redis.from_url(redis_server.url)
        try:
            for blob in (
                b"not msgpack",
                msgpack.packb(["p", [[0.0, ["10.9.9.9:1", 1, 5]]]]),  # not in the pool
                msgpack.packb(["p", [[0.0, [X, 1.5, 5]], [0.0, [X, 1]]]]),  # not integers
                msgpack.packb([7, [[0.0, [X, 1, 5]]]]),  # a sender that is no id
            ):
                await client.publish(f"{b.namespace}:push", blob)
        finally:
            await client.aclose()
        await until(lambda: pusher.stats.bad_entries == 5, "five bad items counted")
        assert b.total() == 0 and pusher.stats.received == 0


async def test_redis_down_is_logged_shown_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="extproc.endpoints.inflight_push")
    shared = SharedInFlight(Redis(port=free_port()), FAST, process_id="me")
    pusher = InFlightPush(Broadcast.client(f"redis://127.0.0.1:{free_port()}"), shared)
    task = asyncio.create_task(pusher.run())
    try:
        shared.acquire(X, 10)
        await until(lambda: pusher.is_degraded and pusher.stats.dropped == 1, "degraded")
        assert pusher.stats.errors >= 1 and pusher.stats.published == 0
        shared.acquire(X, 10)  # the hot path still just counts
        assert shared.requests(X) == 2
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await pusher.aclose()
    assert any("in-flight push: Redis failing" in r.getMessage() for r in caplog.records)


async def test_the_server_pushes_by_default_and_not_when_told(
    settings: Settings, redis_server: RedisServer
) -> None:
    index = IndexSettings(backend="redis", redis_url=redis_server.url)
    s = msgspec.structs.replace(settings, index=index)
    async with App(s, parse_endpoints(",".join(s.endpoints))) as app:
        assert app.inflight_push is not None
        assert isinstance(app.inflight, SharedInFlight) and app.inflight.on_placed is not None
    off = StateSettings(shared_inflight=SharedInFlightSettings(push=False))
    s = msgspec.structs.replace(s, state=off)
    async with App(s, parse_endpoints(",".join(s.endpoints))) as app:
        assert app.inflight_push is None
        assert isinstance(app.inflight, SharedInFlight) and app.inflight.on_placed is None


def test_the_peers_placements_are_counted_once_in_requests_and_tokens() -> None:
    """`peer_placements` (predicted TTFT's `meanPlacements: fleet`): each peer placement once,
    pushed or exchanged, as a (requests, tokens) pair."""
    clock = Clock()
    me = _alone(clock)
    assert me.peer_placements() == (0, 0)
    me._merge(_entry("p", {X: [1, 100]}, {X: [2, 200]}))  # first seen: its one in flight
    assert me.peer_placements() == (1, 100)
    me.pushed("p", X, 3, 350, 0.0)  # its third placement, 150 tokens
    me.pushed("p", X, 3, 350, 0.0)  # a duplicate
    assert me.peer_placements() == (2, 250)
    clock.t += 0.05
    me._merge(_entry("p", {X: [2, 200]}, {X: [4, 400]}))  # the push, and one more of 50
    assert me.peer_placements() == (3, 300)
    me.pushed("stranger", X, 1, 100, 0.0)  # refused: not counted
    # An older peer publishes totals only: its growth has no request count, left out.
    me._merge(
        [*_entry("p", {X: [2, 200]}, {X: [4, 400]}), b"old", msgpack.packb({X: [1, 90]}), b""]
    )
    clock.t += 0.05
    me._merge(
        [*_entry("p", {X: [2, 200]}, {X: [4, 400]}), b"old", msgpack.packb({X: [2, 190]}), b""]
    )
    assert me.peer_placements() == (4, 390)  # the old one's first sighting (1, 90) only
