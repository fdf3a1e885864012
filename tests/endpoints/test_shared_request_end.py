"""Two replicas behind one gateway: the access-log entry of a request held by one replica
reaches the other, which publishes it through real Redis; the holder releases it. A failing
Redis and a garbled peer show on /metrics and in one log line."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from extproc.endpoints.inflight import InFlight
from extproc.endpoints.request_end import Ended, RequestEnds, RequestEndSettings
from extproc.endpoints.shared_request_end import SharedRequestEnds
from extproc.server.families import SHARED_REQUEST_ENDS


def sample(shared: SharedRequestEnds, family: str) -> float:
    """The one sample of `family` as /metrics would show it for `shared`."""
    (fam,) = [f for f in SHARED_REQUEST_ENDS.families(shared.stats) if f.name == family]
    (s,) = fam.samples
    return s.value


@dataclass
class Replica:
    counts: InFlight
    ends: RequestEnds
    shared: SharedRequestEnds


@contextlib.asynccontextmanager
async def replicas(url: str) -> AsyncIterator[tuple[Replica, Replica]]:
    """Replicas a and b sharing request ends through Redis at `url`, both subscribed."""
    pair = []
    for name in "ab":
        counts = InFlight()
        ends = RequestEnds(counts.release, RequestEndSettings(mode="access-log"))
        pair.append(Replica(counts, ends, SharedRequestEnds.from_url(url, ends, process_id=name)))
    tasks = [asyncio.create_task(r.shared.run()) for r in pair]
    try:
        await asyncio.sleep(0.3)  # both subscribed
        yield pair[0], pair[1]
    finally:
        for t in tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for r in pair:
            await r.shared.aclose()


async def test_an_entry_logged_to_another_replica_releases_the_hold(redis_server):
    async with replicas(redis_server.url) as (a, b):
        a.ends.finish("req-1", a.counts.acquire("s1", 100))
        assert a.counts.requests("s1") == 1
        b.ends.ended(Ended("req-1", 0.2, "s1"))  # Envoy logged it to replica b
        await until(lambda: a.counts.requests("s1") == 0)
        assert b.shared.stats.published == 1 and a.shared.stats.applied == 1
        assert b.ends.stats.unmatched == 1 and a.ends.stats.unmatched == 0


async def test_a_redis_outage_is_said_once_shown_degraded_and_heals(redis_server, caplog):
    """Redis gone: each replica says so once, shows degraded (the /metrics gauge reads
    `is_degraded`), drops the entries it could not publish; back: both heal by themselves
    and an entry logged to the other replica releases the hold again."""
    caplog.set_level(logging.INFO, logger="extproc.request_end")
    async with replicas(redis_server.url) as (a, b):
        assert not a.shared.is_degraded and not b.shared.is_degraded
        redis_server.kill()
        b.ends.ended(Ended("lost", 0.1, "s1"))  # cannot be published
        await until(lambda: a.shared.is_degraded and b.shared.is_degraded)
        await until(lambda: b.shared.stats.dropped == 1)
        assert sample(b.shared, "extproc_request_end_forward_dropped") == 1
        assert sample(a.shared, "extproc_request_end_forward_errors") >= 1
        redis_server.start()
        await until(lambda: not a.shared.is_degraded and not b.shared.is_degraded, timeout_s=15)
        await asyncio.sleep(0.3)  # resubscribed
        a.ends.finish("req-2", a.counts.acquire("s1", 100))
        b.ends.ended(Ended("req-2", 0.2, "s1"))
        await until(lambda: a.counts.requests("s1") == 0)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("Redis failing" in m for m in messages) == 2  # once per replica
    assert sum("Redis back after" in m for m in messages) == 2


async def test_garbled_peer_messages_are_counted_on_metrics_and_said_once(redis_server, caplog):
    """A stray publisher's garbage and wrong-shaped entries on the channel: skipped, counted
    in extproc_request_end_forward_bad_entries, one warning line (not one per message); a
    good entry in the same batch still releases its hold."""
    import msgspec
    import redis.asyncio

    caplog.set_level(logging.WARNING, logger="extproc.request_end")
    async with replicas(redis_server.url) as (a, b):
        assert sample(a.shared, "extproc_request_end_forward_bad_entries") == 0
        a.ends.finish("req-3", a.counts.acquire("s1", 100))
        client = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            for _ in range(20):
                await client.publish("extproc:request-ends", b"\xc1 not msgpack")
            batch = [["only", "two"], 7, ["req-3", 0.2, "s1"]]
            await client.publish("extproc:request-ends", msgspec.msgpack.encode(["x", batch]))
        finally:
            await client.aclose()
        await until(lambda: a.counts.requests("s1") == 0)
        await until(lambda: a.shared.stats.bad_entries == 22)
        await until(lambda: b.shared.stats.bad_entries == 22)  # b hears the garbage too
        assert sample(a.shared, "extproc_request_end_forward_bad_entries") == 22
    lines = [r for r in caplog.records if "request ends:" in r.getMessage()]
    # Two reasons (a message, items), one line each per replica within the throttle's interval.
    assert len(lines) == 4, [r.getMessage() for r in lines]


async def until(check, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.05)
