"""Two replicas behind one gateway: the access-log entry of a request held by one replica
reaches the other, which publishes it through real Redis; the holder releases it."""

from __future__ import annotations

import asyncio
import contextlib

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
