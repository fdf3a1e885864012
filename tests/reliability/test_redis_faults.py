"""Redis killed under load, and Redis made slow: routing never stops, lookups are flagged
degraded instead of waited for, and affinity comes back once Redis does."""

from __future__ import annotations

import asyncio
import time

import pytest

from extproc.testing import ExtProcClient
from tests.redis_servers import RedisServer
from tests.reliability.conftest import figure
from tests.reliability.harness import (
    DelayProxy,
    Load,
    chat,
    fake_endpoints,
    picker,
    quantile,
    route,
)

pytestmark = pytest.mark.timing  # decisions read against wall-clock budgets


async def sticky(client: ExtProcClient, conversation: int) -> bool:
    """A new conversation's second turn lands where its first did."""
    first, _ = await route(client, chat(conversation, 0))
    await asyncio.sleep(0.05)  # the decision reaches Redis off the hot path
    second, _ = await route(client, chat(conversation, 1))
    return first == second


async def test_redis_killed_mid_load_routing_continues_and_affinity_recovers(
    redis_server: RedisServer,
):
    endpoints = fake_endpoints(4)
    index = {"backend": "redis", "redis_url": redis_server.url}
    async with picker(endpoints, index=index) as app:
        target = f"127.0.0.1:{app.port}"
        async with ExtProcClient(target) as probe:
            assert all([await sticky(probe, 1000 + i) for i in range(3)])
            load = Load(target).start()
            await asyncio.sleep(1.5)
            before_kill = (load.ok, app.router.stats.lookups_degraded)
            redis_server.kill()
            await asyncio.sleep(3.0)
            during = (load.ok - before_kill[0], app.router.stats.lookups_degraded - before_kill[1])
            # Affinity while Redis is gone: nothing remembers the first turn (the decision
            # could not be written), so the second turn goes wherever load sends it.
            outage_sticky = sum([await sticky(probe, 2000 + i) for i in range(6)])
            redis_server.start()
            restarted = time.monotonic()
            # Recovered: three new conversations in a row stick, with lookups answered.
            conv = 3000
            while time.monotonic() - restarted < 20:
                degraded = app.router.stats.lookups_degraded
                results = []
                for _ in range(3):
                    results.append(await sticky(probe, conv))
                    conv += 1
                if all(results) and app.router.stats.lookups_degraded == degraded:
                    break
            recovery_s = time.monotonic() - restarted
            await load.stop()
        figure(
            "redis_kill",
            requests_ok=load.ok,
            requests_failed=load.failed,
            served_during_outage=during[0],
            lookups_degraded_during_outage=during[1],
            outage_sticky_of_6=outage_sticky,
            recovery_s=round(recovery_s, 2),
        )
        assert load.failed == 0, load.errors[:3]
        assert during[0] > 0, "no request was served while Redis was down"
        assert during[1] > 0, "lookups during the outage were not flagged degraded"
        assert recovery_s < 20, "affinity never came back"


async def test_slow_redis_decisions_do_not_wait_for_it(redis_server: RedisServer):
    # Far above any stall a loaded CI machine causes by itself (0.36 s seen at load 13), so a
    # slow decision can only mean one that waited for Redis.
    delay_s = 1.0
    endpoints = fake_endpoints(4)
    async with DelayProxy(redis_server.port, delay_s) as proxy:
        index = {
            "backend": "redis",
            "redis_url": f"redis://127.0.0.1:{proxy.port}",
            "lookup_budget_s": 0.005,
        }
        async with picker(endpoints, index=index) as app:
            load = Load(f"127.0.0.1:{app.port}").start()
            await asyncio.sleep(4.0)
            await load.stop()
            stats = app.router.stats
            lookups = app.index.stats.lookups  # type: ignore[union-attr]
            p50, p99 = quantile(load.latencies_s, 0.5), quantile(load.latencies_s, 0.99)
            figure(
                "slow_redis",
                injected_delay_ms=int(delay_s * 1000),
                budget_ms=5,
                requests_ok=load.ok,
                requests_failed=load.failed,
                lookups=lookups,
                lookups_degraded=stats.lookups_degraded,
                decision_p50_ms=round(p50 * 1000, 1),
                decision_p99_ms=round(p99 * 1000, 1),
                decision_max_ms=round(max(load.latencies_s) * 1000, 1),
            )
            assert load.failed == 0, load.errors[:3]
            # Every lookup that had to cross the slow link gave up: none waited 200 ms.
            assert stats.lookups_degraded >= 0.9 * lookups
            # Behaviour, not a benchmark: the decision never waits for the injected delay.
            slow = [(i, round(s, 3)) for i, s in enumerate(load.latencies_s) if s >= delay_s]
            assert not slow, slow
