"""Redis killed and restarted under a live index: lookups degrade, then recover by themselves."""

from __future__ import annotations

import asyncio

from extproc.index.base import IndexOptions
from extproc.index.redis import RedisKVIndex
from tests.redis_servers import RedisServer

A = "10.0.0.1:8000"
KEYS = [101, 102, 103]


async def test_redis_outage_degrades_lookups_then_recovers(redis_server: RedisServer) -> None:
    index = RedisKVIndex.from_url(redis_server.url, options=IndexOptions(), write_retry_s=10.0)
    async with index:
        index.record(A, KEYS)
        await index.flush()
        assert (await index.lookup(KEYS)).matches == {A: 3.0}

        redis_server.kill()
        down = await index.lookup(KEYS)
        assert down.degraded and down.matches == {}
        index.record(A, KEYS)  # queued; the writer retries until Redis is back

        redis_server.start()  # same port, empty (no persistence)
        await index.flush()
        async with asyncio.timeout(5):
            while (found := await index.lookup(KEYS)).degraded:
                await asyncio.sleep(0.05)
        assert found.matches == {A: 3.0}
        assert index.stats.lookups_degraded >= 1


async def test_unreachable_redis_never_raises_from_lookup() -> None:
    index = RedisKVIndex.from_url("redis://127.0.0.1:1", lookup_budget_s=0.005)
    async with index:
        for _ in range(3):
            assert (await index.lookup(KEYS)).degraded
        index.record(A, KEYS)
    assert index.stats.lookups_degraded == 3
