"""Two picker processes sharing one Redis index: active-active without losing affinity, and
routing that never stops while Redis is gone."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from extproc.stack import free_port, grpc_health_status, wait_until
from extproc.testing import ExtProcClient, body_chunks, destination, post, request_headers
from tests.redis_servers import RedisServer

ENDPOINTS = "127.0.0.11:8000,127.0.0.12:8000,127.0.0.13:8000"
SYSTEM = "You are a meticulous assistant. " * 80  # ~2.5 KB: several prefix blocks


def chat(conversation: int, turns: int) -> bytes:
    messages = [{"role": "system", "content": f"Conversation {conversation}. " + SYSTEM}]
    for t in range(turns):
        messages.append(
            {"role": "user", "content": f"Question {t} of conversation {conversation}?"}
        )
        if t < turns - 1:
            messages.append({"role": "assistant", "content": f"Answer {t}. " * 20})
    return orjson.dumps({"model": "m", "messages": messages})


class Picker:
    def __init__(self, redis_url: str, log: Path) -> None:
        self.port, self.health, self.admin = free_port(), free_port(), free_port()
        self.log = log
        # Its log, whose last lines a failed start puts in the exception (a start in CI
        # exited 1 once with nothing to read).
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "extproc",
                    "serve",
                    "--plaintext",
                    "--endpoints",
                    ENDPOINTS,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--health-port",
                    str(self.health),
                    "--admin-port",
                    str(self.admin),
                    "--redis-url",
                    redis_url,
                    # No request is in flight at the stop: the default 3 s of serving on
                    # after SIGTERM (for a proxy's health check to notice) only delayed
                    # each teardown (6 s for the two pickers), as Stack's 0 avoids.
                    "--drain-delay",
                    "0",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_until(
                lambda: grpc_health_status(self.health, "readiness") == 1,
                timeout_s=20,
                what="picker",
                proc=self.proc,
                log=log,
            )
        except BaseException:
            self.stop()  # not ready in time: not left running
            raise

    async def route(self, body: bytes) -> str:
        async with ExtProcClient(f"127.0.0.1:{self.port}") as c:
            out = await c.exchange(
                [request_headers(post("/v1/chat/completions")), *body_chunks(body)]
            )
        dest = destination(out[0])
        assert dest is not None, out[0]
        return dest

    def metrics(self) -> dict[str, float]:
        """/metrics now, by sample (name and labels as exported). Plain urllib: with an
        httpx client per read (each sets up a TLS context) the outage test took 1.4-1.9 s
        against 0.8-1.0 s without these reads; read so, 0.9-1.2 s."""
        url = f"http://127.0.0.1:{self.admin}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        return {
            name: float(value)
            for line in text.splitlines()
            if line and not line.startswith("#")
            for name, _, value in [line.rpartition(" ")]
        }

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=15)


@pytest.fixture
def pickers(redis_server: RedisServer, tmp_path: Path) -> Iterator[tuple[Picker, Picker]]:
    started: list[Picker] = []
    try:
        for name in ("a", "b"):
            started.append(Picker(redis_server.url, tmp_path / f"picker-{name}.log"))
        yield started[0], started[1]
    finally:
        for p in started:  # a, even when b did not start
            p.stop()


async def test_next_turn_routed_by_the_other_replica_lands_on_the_same_endpoint(pickers):
    a, b = pickers
    firsts = []
    for conv in range(8):
        first = await a.route(chat(conv, 1))
        firsts.append(first)
        await asyncio.sleep(0.2)  # the decision reaches Redis off the hot path
        assert await b.route(chat(conv, 2)) == first
        assert await a.route(chat(conv, 3)) == first
    assert len(set(firsts)) > 1, "new conversations spread over endpoints"


async def test_routing_never_stops_while_redis_is_down(pickers, redis_server):
    a, b = pickers
    await a.route(chat(0, 1))
    redis_server.kill()
    for conv in range(10):
        assert await a.route(chat(conv, 1)) in ENDPOINTS.split(",")
        assert await b.route(chat(conv, 2)) in ENDPOINTS.split(",")
    redis_server.start()
    # Shown while degraded: no lookup was answered since (none was made), so the gauge still
    # says so. Read after the restart, not before: the outage is not made longer by it.
    assert a.metrics()['extproc_index_degraded{direction="lookups"}'] == 1

    # Affinity returns by itself once Redis is back: for new conversations. Each attempt is
    # one, since a conversation whose next turn missed (b looked before a's write landed,
    # and a loaded CI machine can delay it) stays where that turn went: b's write there is
    # its longest match from then on.
    conversations = iter(range(100, 1000))

    async def sticky() -> bool:
        conv = next(conversations)
        first = await a.route(chat(conv, 1))
        await asyncio.sleep(0.2)
        return await b.route(chat(conv, 2)) == first

    for _ in range(50):
        if await sticky() and await sticky() and await sticky():
            break
        await asyncio.sleep(0.2)
    else:
        pytest.fail("affinity did not come back after Redis restarted")
    # ... and its end: a line each way per failing spell (one, unless a loaded machine
    # timed a few lookups out later), the gauges back to 0.
    said, shown = a.log.read_text(), a.metrics()
    for direction in ("lookups", "writes"):
        spells = said.count(f"kv index: {direction} failing")
        assert spells >= 1 and said.count(f"kv index: {direction} resume after") == spells
        assert shown[f'extproc_index_outages_total{{direction="{direction}"}}'] == spells
        assert shown[f'extproc_index_degraded{{direction="{direction}"}}'] == 0
