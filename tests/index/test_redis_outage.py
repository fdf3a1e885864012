"""Redis killed and restarted under a live index: lookups degrade, then recover by themselves,
and both directions (lookups, writes) say so once each way, in the log and in
`stats.degraded` / `stats.outages` (extproc_index_degraded / _outages)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from extproc.index.base import IndexOptions
from extproc.index.redis import RedisKVIndex
from tests.redis_servers import RedisServer

A = "10.0.0.1:8000"
KEYS = [101, 102, 103]


async def test_redis_outage_degrades_lookups_then_recovers(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="extproc.index.redis")
    index = RedisKVIndex.from_url(redis_server.url, options=IndexOptions(), write_retry_s=10.0)
    async with index:
        index.record(A, KEYS)
        await index.flush()
        assert (await index.lookup(KEYS)).matches == {A: 3.0}
        assert index.stats.degraded == {"lookups": 0, "writes": 0}

        redis_server.kill()
        down = await index.lookup(KEYS)
        assert down.degraded and down.matches == {}
        assert index.stats.degraded["lookups"] == 1
        index.record(A, KEYS)  # queued; the writer retries until Redis is back
        async with asyncio.timeout(5):
            while index.stats.write_errors < 2:  # retried, said once
                await asyncio.sleep(0.05)
        assert index.stats.degraded["writes"] == 1
        for _ in range(3):
            await index.lookup(KEYS)
            await asyncio.sleep(0.06)  # past the breaker's first backoffs: tried again

        redis_server.start()  # same port, empty (no persistence)
        await index.flush()
        assert index.stats.degraded["writes"] == 0
        async with asyncio.timeout(5):
            while (found := await index.lookup(KEYS)).degraded:
                await asyncio.sleep(0.05)
        assert found.matches == {A: 3.0}
        assert index.stats.lookups_degraded >= 1
        assert index.stats.degraded == {"lookups": 0, "writes": 0}
        assert index.stats.outages == {"lookups": 1, "writes": 1}
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    for direction in ("lookups", "writes"):
        assert sum(f"kv index: {direction} failing" in m for m in said) == 1, said
        assert sum(f"kv index: {direction} resume after" in m for m in said) == 1, said
    assert any("more lookups answered degraded meanwhile" in m for m in said), said
    assert any("failed write attempts, 0 blocks dropped meanwhile" in m for m in said), said


async def test_unreachable_redis_never_raises_from_lookup() -> None:
    # A short write retry: the queued write is dropped at close within it, not waited for
    # the 5 s the close gives a flush (the test took 5 s for that alone).
    index = RedisKVIndex.from_url("redis://127.0.0.1:1", lookup_budget_s=0.005, write_retry_s=0.2)
    async with index:
        for _ in range(3):
            assert (await index.lookup(KEYS)).degraded
        index.record(A, KEYS)
    assert index.stats.lookups_degraded == 3
    assert index.stats.writes_dropped == 3 and index.stats.degraded["writes"] == 1
