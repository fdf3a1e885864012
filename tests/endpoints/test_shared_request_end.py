"""Two replicas behind one gateway: the access-log entry of a request held by one replica
reaches the other, which publishes it through real Redis; the holder releases it."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from extproc.endpoints.inflight import InFlight
from extproc.endpoints.request_end import Ended, RequestEnds, RequestEndSettings
from extproc.endpoints.shared_request_end import SharedRequestEnds


async def test_an_entry_logged_to_another_replica_releases_the_hold(redis_server):
    settings = RequestEndSettings(mode="access-log")
    a_counts, b_counts = InFlight(), InFlight()
    a_ends = RequestEnds(a_counts.release, settings)
    b_ends = RequestEnds(b_counts.release, settings)
    a = SharedRequestEnds.from_url(redis_server.url, a_ends, process_id="a")
    b = SharedRequestEnds.from_url(redis_server.url, b_ends, process_id="b")
    tasks = [asyncio.create_task(x.run()) for x in (a, b)]
    try:
        await asyncio.sleep(0.3)  # both subscribed
        a_ends.finish("req-1", a_counts.acquire("s1", 100))
        assert a_counts.requests("s1") == 1
        b_ends.ended(Ended("req-1", 0.2, "s1"))  # Envoy logged it to replica b
        for _ in range(50):
            if a_counts.requests("s1") == 0:
                break
            await asyncio.sleep(0.05)
        assert a_counts.requests("s1") == 0
        assert b.stats.published == 1 and a.stats.applied == 1
        assert b_ends.stats.unmatched == 1 and a_ends.stats.unmatched == 0
    finally:
        for t in tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await a.aclose()
        await b.aclose()


async def test_a_redis_outage_is_said_once_shown_degraded_and_heals(redis_server, caplog):
    """Redis gone: each replica says so once, shows degraded (the /metrics gauge reads
    `is_degraded`), drops the entries it could not publish; back: both heal by themselves
    and an entry logged to the other replica releases the hold again."""
    caplog.set_level(logging.INFO, logger="extproc.request_end")
    settings = RequestEndSettings(mode="access-log")
    a_counts, b_counts = InFlight(), InFlight()
    a_ends = RequestEnds(a_counts.release, settings)
    b_ends = RequestEnds(b_counts.release, settings)
    a = SharedRequestEnds.from_url(redis_server.url, a_ends, process_id="a")
    b = SharedRequestEnds.from_url(redis_server.url, b_ends, process_id="b")
    tasks = [asyncio.create_task(x.run()) for x in (a, b)]
    try:
        await asyncio.sleep(0.3)  # both subscribed
        assert not a.is_degraded and not b.is_degraded
        redis_server.kill()
        b_ends.ended(Ended("lost", 0.1, "s1"))  # cannot be published
        await until(lambda: a.is_degraded and b.is_degraded)
        await until(lambda: b.stats.dropped == 1)
        redis_server.start()
        await until(lambda: not a.is_degraded and not b.is_degraded, timeout_s=15)
        await asyncio.sleep(0.3)  # resubscribed
        a_ends.finish("req-2", a_counts.acquire("s1", 100))
        b_ends.ended(Ended("req-2", 0.2, "s1"))
        await until(lambda: a_counts.requests("s1") == 0)
    finally:
        for t in tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await a.aclose()
        await b.aclose()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("Redis failing" in m for m in messages) == 2  # once per replica
    assert sum("Redis back after" in m for m in messages) == 2


async def until(check, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.05)
