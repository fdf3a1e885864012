"""The retained snapshot of shared growth, against a real redis-server: a replica that starts
after records were published learns them; after a Redis restart it reads the snapshot again;
forged snapshot entries are refused and counted like pushed ones; a snapshot that cannot be
read is said and shows degraded; the snapshot and its read stay bounded."""

from __future__ import annotations

import asyncio
import logging

import msgspec
import pytest
import redis.asyncio

from extproc.redis_broadcast import Broadcast
from extproc.retained import Retention
from extproc.scheduling.plugins.sessions import BoundedSessionsFilter
from extproc.server.shared_growth import SharedGrowth
from tests.redis_servers import RedisServer
from tests.server.broadcasting import running, until
from tests.server.test_shared_growth import HEADER, SHARING, converse, new_session

KEY = "{extproc:growth}:retained"
ORDER = "{extproc:growth}:retained:order"


async def settled(client: redis.asyncio.Redis, key: str, n: int) -> None:
    """Waits up to ~5 s for the sorted set or hash `key` to hold `n` entries (a snapshot is
    written just after its batch is published)."""
    for _ in range(100):
        size = await (client.zcard(key) if key == ORDER else client.hlen(key))
        if size == n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {key} with {n} entries")


def replica(url: str, pid: str, **kw: int) -> tuple[BoundedSessionsFilter, SharedGrowth]:
    f = BoundedSessionsFilter(SHARING)
    return f, SharedGrowth.from_url(url, SharedGrowth.records([f]), process_id=pid, **kw)


async def test_a_replica_started_late_learns_what_was_published_before(
    redis_server: RedisServer,
) -> None:
    fa, a = replica(redis_server.url, "a")
    fb, b = replica(redis_server.url, "b")
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        async with running(a):
            await until(lambda: a.stats.snapshot_reads == 1, "a subscribed")
            converse(fa, 0, 0)  # a learns tenant 0's growth and publishes it; b is not up
            await until(lambda: a.stats.published == 1, "a published")
            await settled(client, KEY, 1)
            assert 0 < await client.ttl(KEY) <= 3600 and 0 < await client.ttl(ORDER) <= 3600
            async with running(b):  # b starts late: pub/sub alone would never tell it
                await until(lambda: b.stats.applied == 1, "b learns from the snapshot")
                assert b.stats.snapshot_reads == 1 and b.stats.snapshot_entries == 1
                new_session(fb, 1)
                assert fb.stats.kept_together == 1 and fb.stats.growth_unknown == 0
                # The same record rising again replaces its entry; another one adds its own.
                for grown in [(3, (77,)), (4, (77,)), (2, (78,))]:
                    fa.sessions.on_grown(grown)  # type: ignore[misc]
                await until(lambda: b.stats.applied == 4, "pushed as before")
                await settled(client, KEY, 3)
            assert a.stats.bad_entries == b.stats.bad_entries == 0
    finally:
        await client.aclose()


async def test_after_a_redis_restart_the_snapshot_is_read_again(
    redis_server: RedisServer,
) -> None:
    fa, a = replica(redis_server.url, "a")
    _, b = replica(redis_server.url, "b")
    async with running(a, b):
        await until(lambda: b.stats.snapshot_reads == 1, "b subscribed")
        converse(fa, 0, 0)
        await until(lambda: b.stats.applied == 1, "b merges a's pushed record")
        # Redis restarts with its data (saved first, as a persistent deployment would): b's
        # subscription is cut, and on reconnecting it reads the snapshot again.
        client = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            await client.save()
        finally:
            await client.aclose()
        redis_server.kill()
        await until(lambda: b.is_degraded, "b sees Redis gone")
        redis_server.start()
        await until(lambda: b.stats.snapshot_reads == 2, "b reads the snapshot again")
        await until(lambda: not b.is_degraded, "b recovered")
        assert b.stats.applied == 2 and b.stats.snapshot_entries == 1
        assert b.stats.bad_entries == 0


async def test_a_snapshot_lost_with_redis_is_written_again_for_later_replicas(
    redis_server: RedisServer,
) -> None:
    fa, a = replica(redis_server.url, "a")
    async with running(a):
        await until(lambda: a.stats.snapshot_reads == 1, "a subscribed")
        assert a.stats.reseeded == 0  # nothing learned yet: nothing to write back
        converse(fa, 0, 0)
        await until(lambda: a.stats.published == 1, "a published")
        redis_server.kill()  # no persistence: the snapshot is gone with it
        await until(lambda: a.is_degraded, "a sees Redis gone")
        redis_server.start()
        await until(lambda: a.stats.snapshot_reads == 2, "a reads the snapshot, empty")
        await until(lambda: a.stats.reseeded > 0, "a writes what it learned back")
        await until(lambda: a.stats.published > 1, "published again")
        fc, c = replica(redis_server.url, "c")  # a replica starting after the restart
        async with running(c):
            await until(lambda: c.stats.applied > 0, "c learns from the rewritten snapshot")
            new_session(fc, 1)
            assert fc.stats.kept_together == 1 and fc.stats.growth_unknown == 0
            assert c.stats.reseeded == 0 and c.stats.bad_entries == 0


async def test_forged_snapshot_entries_are_refused_and_counted(
    redis_server: RedisServer, caplog
) -> None:
    caplog.set_level(logging.WARNING, logger="extproc.server.shared_growth")
    f, shared = replica(redis_server.url, "a")
    enc = msgspec.msgpack.encode
    forged = {
        b"1": b"not msgpack \xc1",  # undecodable
        b"2": enc(["b", ["7", 3, [1, 2]]]),  # no such filter
        b"3": enc(["b", ["0", 1 << 30, [1, 2]]]),  # growth out of bounds
        b"4": enc(["b", ["0", 3, [1, -2]]]),  # not block keys
        b"5": enc(["b", "not a triple"]),  # malformed item
        # Past the entry size bound (1,000 keys of 5 bytes).
        b"6": enc(["b", ["0", 3, list(range(1 << 20, (1 << 20) + 1000))]]),
        b"7": enc(["a", ["0", 5, list(range(200, 208))]]),  # "its own": skipped, not applied
        b"8": enc(["b", ["0", 3, list(HEADER)]]),  # the only valid one
    }
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        await client.hset(KEY, mapping=forged)  # type: ignore[arg-type]
        async with running(shared):
            await until(lambda: shared.stats.snapshot_reads == 1, "the snapshot read")
            await until(lambda: shared.stats.applied == 1, "the valid entry")
            assert shared.stats.bad_entries == 6
            assert shared.stats.snapshot_entries == 7  # the oversized one never handed on
            assert not shared.is_degraded
    finally:
        await client.aclose()
    assert f.sessions.learned(tuple(range(200, 208)), 8) is None
    lines = [r.getMessage() for r in caplog.records if r.name.endswith("shared_growth")]
    assert 1 <= len(lines) <= 6, lines  # one line per reason, not per entry


async def test_a_broken_snapshot_is_said_shows_degraded_and_spares_pushed_records(
    redis_server: RedisServer, caplog
) -> None:
    caplog.set_level(logging.WARNING, logger="extproc.server.shared_growth")
    fa, a = replica(redis_server.url, "a")
    _, b = replica(redis_server.url, "b")
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        await client.set(KEY, b"not a hash")  # a stray writer: every read and write fails
        async with running(a, b):
            await until(lambda: a.is_degraded and b.is_degraded, "degraded")
            assert a.stats.snapshot_reads == b.stats.snapshot_reads == 0
            # Pub/sub goes on: a's record reaches b though it cannot be kept.
            converse(fa, 0, 0)
            await until(lambda: b.stats.applied == 1, "pushed despite the broken snapshot")
            await until(lambda: a.stats.errors >= 2, "a's failed write counted")
            said = " ".join(r.getMessage() for r in caplog.records)
            assert "snapshot was not read" in said and "snapshot was not written" in said
            await client.delete(KEY)
            await until(lambda: a.stats.snapshot_reads == b.stats.snapshot_reads == 1, "read")
            # Whoever reads it empty writes what it holds back (the record the broken key
            # never kept); the other may read it after that write and find it there, so
            # which of them reseeds is a race: one at least. a's and b's copies of the one
            # record are one entry.
            await until(lambda: a.stats.reseeded + b.stats.reseeded > 0, "rewritten")
            await settled(client, KEY, 1)
            # a's degraded flag falls once a batch of its own is kept (its reseed, or else
            # its next record); b's once its read went through.
            converse(fa, 1, 0)
            await until(lambda: not a.is_degraded and not b.is_degraded, "recovered")
            await settled(client, KEY, 2)
    finally:
        await client.aclose()


async def test_the_snapshot_and_its_read_stay_bounded(redis_server: RedisServer) -> None:
    f, a = replica(redis_server.url, "a", retained=5)
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        async with running(a):
            await until(lambda: a.stats.snapshot_reads == 1, "a subscribed")
            for i in range(12):  # 12 records of distinct sessions, one batch at a time
                f.sessions.on_grown((i + 1, (1000 + i,)))  # type: ignore[misc]
                await until(lambda i=i: a.stats.published == i + 1, "published")
            await settled(client, ORDER, 5)
            assert await client.hlen(KEY) == 5
            # The newest kept: the last five records' growth figures.
            kept = [msgspec.msgpack.decode(v)[1][1] for v in await client.hvals(KEY)]
            assert sorted(kept) == [8, 9, 10, 11, 12]
            # A stray writer filling the hash cannot make a reader take more than its bound.
            await client.hset(KEY, mapping={str(i).encode(): b"x" for i in range(50)})
        _, b = replica(redis_server.url, "b", retained=5)
        async with running(b):
            await until(lambda: b.stats.snapshot_reads == 1, "b read")
            assert b.stats.snapshot_entries == 5
    finally:
        await client.aclose()


def test_a_timed_channel_cannot_retain() -> None:
    # A snapshot entry carries no wait in its sender's batch: a peer could not date it.
    client = Broadcast.client("redis://127.0.0.1:1")
    with pytest.raises(ValueError, match="timed"):
        Broadcast(
            client,
            "c",
            lambda _: None,
            process_id="a",
            name="t",
            logger=logging.getLogger(__name__),
            failed_msg="%r",
            healed_msg="%d",
            timed=True,
            retention=Retention(lambda item: b""),
        )
