"""A slow Redis is waited for, a stalled or dead one is not (index/lookup_health.py).

Before this, a lookup had a fixed 5 ms budget and three timeouts in a row opened the breaker
for 0.4-1 s: a Redis answering in 20 ms, or a starved event loop that read an in-time answer
after its own timer, answered every lookup degraded. Real redis-server throughout; the slow
one behind a TCP proxy that delays every chunk."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio import Redis

from extproc.index.base import IndexOptions
from extproc.index.lookup_health import LookupHealth
from extproc.index.redis import RedisKVIndex
from tests.redis_servers import RedisServer
from tests.reliability.harness import DelayProxy

pytestmark = pytest.mark.timing  # lookups read against wall-clock budgets

A = "10.0.0.1:8000"
KEYS = [101, 102, 103]


async def _seeded(url: str, **kwargs: float) -> RedisKVIndex:
    index = RedisKVIndex.from_url(url, options=IndexOptions(), **kwargs)  # type: ignore[arg-type]
    await index.__aenter__()
    index.record(A, KEYS)
    await index.flush()
    return index


async def test_a_slow_redis_is_waited_for_not_cut_off(redis_server: RedisServer) -> None:
    # ~20 ms a lookup (10 ms each way): 4x the 5 ms floor, well under the 200 ms cap.
    async with DelayProxy(redis_server.port, 0.01) as proxy:
        index = await _seeded(f"redis://127.0.0.1:{proxy.port}", lookup_budget_max_s=0.2)
        try:
            answers = []
            for _ in range(60):
                answers.append(await index.lookup(KEYS))
                await asyncio.sleep(0.005)
        finally:
            await index.__aexit__(None, None, None)
    # The first lookups time out at the 5 ms floor; their answers, late, raise the budget.
    assert index.stats.lookups_timed_out >= 1
    assert index.stats.lookups_late >= 1
    assert index.stats.lookup_budget_s >= 0.02
    tail = answers[-20:]
    assert all(not a.degraded and a.matches == {A: 3.0} for a in tail), [
        a.degraded for a in answers
    ]
    assert index.stats.lookups_failed == 0


async def test_an_answer_read_late_by_a_starved_loop_is_used(redis_server: RedisServer) -> None:
    # Budget pinned at 5 ms; Redis answers in well under 1 ms, but the loop is blocked for
    # 30 ms right after the lookup is sent: its timer and the answer are served in one turn.
    index = await _seeded(redis_server.url, lookup_budget_s=0.005, lookup_budget_max_s=0.005)
    try:
        await index.lookup(KEYS)  # the connection is set up
        results = []
        for _ in range(5):
            lookup = asyncio.create_task(index.lookup(KEYS))
            await asyncio.sleep(0)  # the lookup sends its command and waits
            time.sleep(0.03)  # the loop is starved (another request's CPU work, say)
            results.append(await lookup)
    finally:
        await index.__aexit__(None, None, None)
    assert all(not r.degraded and r.matches == {A: 3.0} for r in results)
    assert index.stats.lookups_in_grace >= 1
    assert index.stats.lookups_timed_out == 0


async def test_a_stalled_redis_opens_the_breaker_and_a_late_answer_closes_it(
    redis_server: RedisServer,
) -> None:
    # A 0.8 s pause, under the 1 s cap: its late answers prove Redis alive again. The loop
    # below stops 0.3 s before the pause ends: on a busy machine the pause starts (on the
    # server) a while before `started`, and a lookup after its end is answered in time.
    index = await _seeded(redis_server.url, lookup_budget_s=0.005, lookup_budget_max_s=1.0)
    admin = Redis(port=redis_server.port)
    try:
        assert not (await index.lookup(KEYS)).degraded
        await admin.execute_command("CLIENT", "PAUSE", "800", "ALL")
        # Lookups time out and their calls stay unanswered: after >= 3 of them over >= 0.1 s
        # the breaker opens and lookups answer degraded without waiting.
        opened_after = None
        started = time.monotonic()
        while time.monotonic() - started < 0.5:
            t0 = time.perf_counter()
            got = await index.lookup(KEYS)
            assert got.degraded
            if time.perf_counter() - t0 < 0.002 and index.stats.lookups_timed_out >= 3:
                opened_after = time.monotonic() - started
                break
            await asyncio.sleep(0.01)
        assert opened_after is not None, "the breaker never opened on a stalled Redis"
        assert index.stats.lookups_late == 0
        # When the pause ends, the timed-out calls answer: the breaker closes at once.
        async with asyncio.timeout(10):
            while (await index.lookup(KEYS)).degraded:
                await asyncio.sleep(0.02)
        assert index.stats.lookups_late >= 1
    finally:
        await admin.aclose()
        await index.__aexit__(None, None, None)


async def test_a_dead_redis_degrades_at_once(redis_server: RedisServer) -> None:
    index = await _seeded(redis_server.url)
    try:
        redis_server.kill()
        first = await index.lookup(KEYS)  # refused: an error, the breaker opens at once
        assert first.degraded and index.stats.lookups_failed == 1
        t0 = time.perf_counter()
        for _ in range(20):
            assert (await index.lookup(KEYS)).degraded
        assert time.perf_counter() - t0 < 0.5  # no lookup waited for Redis
        assert index.stats.lookups_failed == 1
        assert index.stats.lookups_degraded == 21
    finally:
        await index.__aexit__(None, None, None)


def test_the_budget_follows_the_p90_within_its_bounds() -> None:
    now = [0.0]
    health = LookupHealth(0.005, 0.05, clock=lambda: now[0])
    assert health.budget() == 0.005
    for _ in range(32):
        health.answered(0.012)
    assert health.budget() == 0.024  # 2 x p90
    assert health.budget(0.5) == 0.5  # a request may ask for more
    for _ in range(256):
        health.answered(0.2)
    assert health.budget() == 0.05  # capped
    for _ in range(256):
        health.answered(0.0001)
    assert health.budget() == 0.005  # floored


def test_timeouts_open_the_breaker_only_when_they_stay_unanswered() -> None:
    now = [0.0]
    health = LookupHealth(0.005, 0.05, clock=lambda: now[0])
    # Three timeouts within 10 ms, then a late answer: a slow Redis, never open.
    for _ in range(3):
        assert health.timed_out() is None
        now[0] += 0.005
    health.answered(0.03, late=True)
    # Timeouts over more than 0.1 s without any answer: stalled, open.
    for _ in range(3):
        backoff = health.timed_out()
        now[0] += 0.06
    assert backoff is not None and health.is_open()
    health.answered(0.2, late=True)  # slower than the 50 ms cap: no proof of health
    assert health.is_open()
    health.answered(0.03, late=True)  # a late answer within the cap: closed again
    assert not health.is_open()
