"""Shared in-flight counts against a real redis-server: processes see each other's load, a
dead process's load expires, and a Redis outage degrades to local counts and heals."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import msgpack
import pytest
from redis.asyncio import Redis

from extproc.endpoints.inflight import InFlight
from extproc.endpoints.shared_inflight import (
    SharedInFlight,
    SharedInFlightSettings,
    default_process_id,
)
from tests.redis_servers import RedisServer, free_port

X, Y = "10.0.0.1:8000", "10.0.0.2:8000"
FAST = SharedInFlightSettings(interval_s=0.02, ttl_s=0.3, timeout_s=0.2, max_backoff_s=0.1)
# Stepped exchanges run on the test's clock, one per `Steps.step`: nothing there is timed by
# the Redis timeout, so it is generous. With FAST's 0.2 s, the unit pass (SCHED_IDLE, beside
# the e2e pass) once starved an exchange past it: a failed exchange is not counted, its loop
# then slept for the next step, and the step waiting for the count timed out.
STEPPED = SharedInFlightSettings(interval_s=0.02, ttl_s=0.3, timeout_s=5.0, max_backoff_s=0.1)


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
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="extproc.endpoints.shared_inflight")
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
        await until(lambda: a.stats.bad_entries >= 6)  # met again at every exchange
        assert a.requests(X) == 0
    # Said, but once per 10 s, not at every exchange: one line for the undecodable counts.
    lines = [r.getMessage() for r in caplog.records if "do not decode" in r.getMessage()]
    assert len(lines) == 1, lines


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


class Steps:
    """Exchange loops that run one exchange per `step` (their sleep waits for the test) on a
    clock the test sets, so what happens between two exchanges is the test's to choose."""

    def __init__(self) -> None:
        self.now = 100.0
        self._go: dict[str, asyncio.Queue[None]] = {}

    def sleep_of(self, process_id: str) -> Callable[[float], Awaitable[None]]:
        go = self._go[process_id] = asyncio.Queue()

        async def sleep(_: float) -> None:
            await go.get()

        return sleep

    async def step(self, *shared: SharedInFlight) -> None:
        for s in shared:
            n = s.stats.exchanges
            self._go[s.process_id].put_nowait(None)
            await until(lambda s=s, n=n: s.stats.exchanges > n)  # type: ignore[misc]


@contextlib.asynccontextmanager
async def stepped(
    url: str,
    steps: Steps,
    process_id: str | None = None,
    settings: SharedInFlightSettings = STEPPED,
) -> AsyncIterator[SharedInFlight]:
    pid = process_id or default_process_id()
    shared = SharedInFlight.from_url(
        url, settings=settings, process_id=pid, clock=lambda: steps.now, sleep=steps.sleep_of(pid)
    )
    task = asyncio.create_task(shared.run())
    try:
        await until(lambda: shared.stats.exchanges >= 1)
        yield shared
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await shared.aclose()


async def test_an_arrival_and_an_end_between_two_exchanges_are_dated_exactly(
    redis_server: RedisServer,
) -> None:
    """b's request ends and another as large starts between two of a's exchanges: b's
    in-flight total does not move, its placement counters do. a dates the new tokens at the
    exchange that brought them, not as the old ones computed long ago."""
    steps = Steps()
    async with stepped(redis_server.url, steps) as a, stepped(redis_server.url, steps) as b:
        first = b.acquire(X, 1000)
        await steps.step(b, a)
        assert a.arrivals.total(X) == 1000
        steps.now += 5.0
        b.release(first)
        b.acquire(X, 1000)
        await steps.step(b, a)
        assert a.tokens(X) == 1000 and a.arrivals.total(X) == 1000
        assert a.arrivals.pending(X, steps.now, tps=1000.0) == 1000.0
        assert a.arrivals.pending(X, steps.now + 0.5, tps=1000.0) == 500.0
        # Both requests counted; the totals' growth saw the first only.
        assert (a.stats.peer_arrivals, a.stats.peer_arrived_tokens) == (2, 2000)
        assert a.stats.peer_growth_tokens == 1000
        assert (b.stats.placed, b.stats.placed_tokens) == (2, 2000)
        assert a.stats.peers == 1 and a.stats.legacy_peers == 0 and a.stats.counter_resets == 0
        # A request placed and ended between two exchanges: counted, nothing left ahead.
        b.release(b.acquire(Y, 300))
        await steps.step(b, a)
        assert a.stats.peer_arrivals == 3 and a.arrivals.total(Y) == 0
        assert a.arrivals.pending(Y, steps.now, tps=1.0) == 0.0


async def test_own_arrivals_are_dated_from_the_own_placements(redis_server: RedisServer) -> None:
    steps = Steps()
    async with stepped(redis_server.url, steps) as a, stepped(redis_server.url, steps) as b:
        own = a.acquire(X, 2000)
        await steps.step(a)
        steps.now += 3.0
        a.release(own)
        a.acquire(X, 2000)  # a's own total stays 2,000; the tokens are new
        b.acquire(X, 1000)
        await steps.step(b, a)
        # The own 2,000 are ahead of the peers' 1,000 in the shared lane at 3.5 s.
        assert a.arrivals.pending_shared(X, steps.now + 0.5, tps=1000.0) == 1000.0


# The exchange of the version before the placement counters (its KEYS: load, live), as a
# process of that version runs it during a rolling upgrade, and how it read the entries.
OLD_EXCHANGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local dead = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for i = 1, #dead, 1000 do
  redis.call('HDEL', KEYS[1], unpack(dead, i, math.min(i + 999, #dead)))
end
if #dead > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now) end
redis.call('ZADD', KEYS[2], now + ttl, ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('PEXPIRE', KEYS[2], ttl)
local all = redis.call('HGETALL', KEYS[1])
local out = {}
for i = 1, #all, 2 do
  if all[i] ~= ARGV[1] and all[i + 1] ~= '' then out[#out + 1] = all[i + 1] end
end
return out
"""
OLD_KEYS = ("{extproc:inflight}:load", "{extproc:inflight}:live")


async def old_exchange(raw: Redis, pid: str, load: dict[str, list[int]]) -> dict[str, list[int]]:
    """One exchange by a process of the older version: publishes `load`, returns the
    others' summed as it read them (a blob it cannot read raises, as its reader skipped)."""
    blob = msgpack.packb(load) if load else b""
    blobs = await raw.eval(OLD_EXCHANGE, 2, *OLD_KEYS, pid, "2000", blob)
    seen: dict[str, list[int]] = {}
    for b in blobs:
        for address, (n, t) in msgpack.unpackb(b).items():
            got = seen.setdefault(address, [0, 0])
            got[0] += int(n)
            got[1] += int(t)
    return seen


async def test_a_fleet_of_two_versions_counts_each_others_load(
    redis_server: RedisServer,
) -> None:
    """Rolling upgrade: a process of the older version (no placement counters) and a new
    one share a namespace. Each counts the other's in-flight load; the new one dates the
    older one's arrivals by its total's growth (an arrival hidden by an end as before)."""
    steps = Steps()
    async with stepped(redis_server.url, steps) as new, Redis.from_url(redis_server.url) as raw:
        px, py = new.acquire(X, 700), new.acquire(Y, 5)
        await steps.step(new)
        assert await old_exchange(raw, "old", {X: [2, 3000]}) == {X: [1, 700], Y: [1, 5]}
        await steps.step(new)
        assert (new.requests(X), new.tokens(X), new.arrivals.total(X)) == (3, 3700, 3000)
        assert new.stats.legacy_peers == 1 and new.stats.peers == 1
        assert new.stats.bad_entries == 0 and new.stats.peer_arrived_tokens == 3000
        steps.now += 5.0
        # One of its requests ended, one as large started: its total says nothing arrived.
        await old_exchange(raw, "old", {X: [2, 3000]})
        await steps.step(new)
        assert new.arrivals.pending(X, steps.now, tps=1000.0) == 0.0
        await old_exchange(raw, "old", {X: [3, 4000]})
        await steps.step(new)
        assert new.arrivals.pending(X, steps.now, tps=1000.0) == 1000.0  # its growth
        assert new.stats.peer_arrived_tokens == 4000 and new.stats.peer_arrivals == 2
        # Idle, the new process publishes an empty load, which the old one skips.
        new.release(px)
        new.release(py)
        await steps.step(new)
        assert await old_exchange(raw, "old", {}) == {}
        await steps.step(new)
        assert new.requests(X) == 0 and new.stats.peers == 0  # the old one went idle too


async def test_counters_going_back_restart_a_peers_dating(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer restarted under the same id publishes counters below the last ones seen: no
    negative or huge arrivals; its in-flight tokens arrive anew, counted and logged once."""
    caplog.set_level(logging.WARNING, logger="extproc.endpoints.shared_inflight")
    steps = Steps()
    async with stepped(redis_server.url, steps) as a:
        async with stepped(redis_server.url, steps, process_id="peer") as b:
            for _ in range(5):
                b.release(b.acquire(X, 10_000))
            b.acquire(X, 800)
            await steps.step(b, a)
            steps.now += 10.0
        # Withdrawn and back at once under its id (a's next exchange sees both at once).
        async with stepped(redis_server.url, steps, process_id="peer") as b2:
            b2.acquire(X, 300)
            await steps.step(b2, a)
            assert a.stats.counter_resets == 1
            assert a.arrivals.total(X) == 300 and a.tokens(X) == 300
            assert a.arrivals.pending(X, steps.now, tps=0.0) == 300.0
            arrived = a.stats.peer_arrived_tokens
            b2.acquire(X, 200)
            await steps.step(b2, a)
            assert a.stats.peer_arrived_tokens == arrived + 200  # counted on from there
            assert a.stats.counter_resets == 1
    resets = [r for r in caplog.records if "went backwards" in r.getMessage()]
    assert len(resets) == 1


async def test_counters_of_a_process_an_older_one_purged_are_dropped(
    redis_server: RedisServer,
) -> None:
    """An older version's exchange purges an expired process from the load hash and the live
    set only; the next new exchange drops its counters too."""
    placed = "{extproc:inflight}:placed"
    steps = Steps()
    long_ttl = SharedInFlightSettings(interval_s=0.02, ttl_s=30.0, timeout_s=5.0)  # keys live
    async with (
        Redis.from_url(redis_server.url) as raw,
        stepped(redis_server.url, steps, settings=long_ttl) as a,
    ):
        crashed = SharedInFlight(Redis.from_url(redis_server.url), FAST, process_id="crashed")
        crashed.acquire(X, 10)
        loop = asyncio.create_task(crashed.run())
        await until(lambda: crashed.stats.exchanges >= 1)
        loop.cancel()  # a crash: nothing withdrawn
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        await crashed._client.aclose()
        await steps.step(a)
        assert await raw.hexists(placed, "crashed")
        await asyncio.sleep(FAST.ttl_s + 0.05)  # type: ignore[operator]
        await old_exchange(raw, "old", {})
        assert not await raw.hexists("{extproc:inflight}:load", "crashed")
        await steps.step(a)
        assert not await raw.hexists(placed, "crashed") and await raw.hexists(placed, a.process_id)


async def test_counters_of_a_server_idle_for_long_are_pruned_and_restart_from_zero(
    redis_server: RedisServer,
) -> None:
    """b forgets its counters for a server it has had nothing on for `counters_idle_s` (a
    replaced pod's address would otherwise ride every exchange forever); a reads that as
    pruned, not as counters going back, and counts b's next placement there as usual. A
    server with a request in flight keeps its counters however long."""
    raw_placed = "{extproc:inflight}:placed"
    steps = Steps()
    async with (
        Redis.from_url(redis_server.url) as raw,
        stepped(redis_server.url, steps) as a,
        stepped(redis_server.url, steps) as b,
    ):
        b.release(b.acquire(X, 500))
        held = b.acquire(Y, 700)
        await steps.step(b, a)  # X seen idle from here
        steps.now += STEPPED.counters_idle_s - 1
        await steps.step(b, a)
        assert b.stats.counters_pruned == 0
        steps.now += 2
        await steps.step(b, a)
        assert b.stats.counters_pruned == 1
        published = msgpack.unpackb(await raw.hget(raw_placed, b.process_id))
        assert set(published) == {Y}  # Y's request is still in flight
        # a first saw b with Y's request in flight (X's had ended): that one arrival only.
        assert a.stats.counter_resets == 0 and a.stats.peer_arrivals == 1
        b.acquire(X, 300)
        await steps.step(b, a)
        assert a.stats.counter_resets == 0
        assert (a.stats.peer_arrivals, a.stats.peer_arrived_tokens) == (2, 1000)
        assert a.arrivals.total(X) == 300
        b.release(held)
