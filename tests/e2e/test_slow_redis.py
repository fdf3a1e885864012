"""`extproc serve` behind Envoy on a slow Redis answers its index lookups, and on a dead one
degrades at once (index/lookup_health.py, issue 14, eighth session).

A real redis-server behind a TCP proxy that delays every chunk 8 ms each way: every lookup
takes 16 ms or more, over the 5 ms floor of the budget. Before, every such lookup timed
out, three in a row opened the breaker for up to a second, and every request was routed
blind (degraded) while Redis was up. Now the budget follows the measured latency and the
lookups answer. Then redis-server is killed: lookups fail with a connection error, the
breaker opens at the first one and requests go on routed by load, each counted degraded."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import httpx
import pytest

from extproc.stack import Stack, StackOptions
from tests.redis_servers import RedisServer
from tests.reliability.harness import DelayProxy

DELAY_S = 0.008
# Long enough for several prefix blocks at any calibration; one shared head per request.
HEAD = "You are a careful agent. " * 60


@pytest.fixture
def slow_redis(redis_server: RedisServer) -> Iterator[str]:
    """redis_server's URL through a DelayProxy run on a loop of its own (the Stack and the
    test are synchronous)."""
    ready = threading.Event()
    stop: list[asyncio.Event] = []
    port: list[int] = []
    loop = asyncio.new_event_loop()

    async def serve() -> None:
        async with DelayProxy(redis_server.port, DELAY_S) as proxy:
            port.append(proxy.port)
            stop.append(asyncio.Event())
            ready.set()
            await stop[0].wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield f"redis://127.0.0.1:{port[0]}"
    finally:
        loop.call_soon_threadsafe(stop[0].set)
        thread.join(10)
        loop.close()


def _counters(stack: Stack) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{stack.picker_admin_port}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("extproc_index_lookup"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _send(http: httpx.Client, first: int, n: int) -> None:
    for i in range(first, first + n):
        body = {"model": "m", "messages": [{"role": "user", "content": f"{HEAD} task {i}"}]}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text


def test_a_slow_redis_answers_lookups_and_a_dead_one_degrades_at_once(
    slow_redis: str, redis_server: RedisServer
) -> None:
    with (
        Stack(StackOptions(upstreams=2, redis_url=slow_redis)) as stack,
        httpx.Client(base_url=stack.url, timeout=30) as http,
    ):
        _send(http, 0, 30)  # the budget learns the latency
        warm = _counters(stack)
        _send(http, 30, 30)
        slow = _counters(stack)
        redis_server.kill()
        _send(http, 60, 20)
        dead = _counters(stack)
    why = {"warm": warm, "slow": slow, "dead": dead}

    def grew(name: str, a: dict[str, float], b: dict[str, float]) -> float:
        return b[f"extproc_index_{name}"] - a[f"extproc_index_{name}"]

    assert grew("lookups_total", warm, slow) >= 30, why
    # 16 ms+ a lookup against a 5 ms floor: the old budget degraded every one of them.
    assert grew("lookups_degraded_total", warm, slow) <= 5, why
    assert slow["extproc_index_lookup_budget_seconds"] >= 2 * DELAY_S, why
    assert slow["extproc_index_lookups_late_total"] >= 1, why  # the timeouts that taught it
    assert slow["extproc_index_lookups_failed_total"] == 0, why
    # Dead: refused connections, the breaker opens at the first; all 20 routed degraded,
    # (nearly) none of them waiting out a budget first.
    assert dead["extproc_index_lookups_failed_total"] >= 1, why
    assert grew("lookups_degraded_total", slow, dead) >= 20, why
    assert grew("lookups_timed_out_total", slow, dead) <= 2, why
