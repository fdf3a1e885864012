"""The live-session record shared through a real redis-server: replicas converge on the same
sessions per server, any replica finds a session another placed, a replica that starts late
catches up, and a Redis outage degrades to each replica's own record (log line and metric
signal) and heals."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable

import pytest
from msgspec import msgpack
from redis.asyncio import Redis

from extproc.core import Decision, Prompt
from extproc.scheduling.plugins.sessions import BoundedSessionsFilter
from extproc.server.shared_sessions import SharedSessions
from tests.redis_servers import RedisServer
from tests.scheduling.helpers import cand
from tests.scheduling.test_sessions import SHARED, held, turn


@contextlib.asynccontextmanager
async def replica(
    url: str, name: str, params: BoundedSessionsFilter.Params | None = None
) -> AsyncIterator[tuple[BoundedSessionsFilter, SharedSessions]]:
    f = BoundedSessionsFilter(params or BoundedSessionsFilter.Params(epsilon=0.0))
    shared = SharedSessions.from_url(
        url, SharedSessions.records([f]), process_id=name, window_s=120.0,
        block_s=0.2, timeout_s=0.3,
    )  # fmt: skip
    task = asyncio.create_task(shared.run())
    try:
        yield f, shared
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await shared.aclose()


async def until(pred: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not pred():
            await asyncio.sleep(0.01)


def place(f: BoundedSessionsFilter, session: int, n: int, home: dict[int, str]) -> str:
    """Turn `n` of `session` through the filter, as the index would show it: the shared
    prompt held where any session lives, the session's previous turn held at its home."""
    r = turn(session, n)
    prev = home.get(session)
    cands = [
        cand(a, prefix=held(session, n - 1) if a == prev and n else
             len(SHARED) if a in home.values() else 0)
        for a in "abc"
    ]  # fmt: skip
    kept = f.filter(r, cands)
    chosen = prev if n and prev in [c.endpoint.address for c in kept] else kept[0].endpoint.address
    f.observe(r, cands, Decision(endpoints=(cand(chosen).endpoint,)))
    home[session] = chosen
    return chosen


async def test_replicas_agree_on_sessions_per_server_and_find_each_others(
    redis_server: RedisServer,
) -> None:
    async with (
        replica(redis_server.url, "r0") as (f0, s0),
        replica(redis_server.url, "r1") as (f1, s1),
        replica(redis_server.url, "r2") as (f2, _),
    ):
        filters = [f0, f1, f2]
        home: dict[int, str] = {}
        # New sessions arrive round-robin over the replicas (as Envoy spreads streams), each
        # after the previous one's placement was exchanged.
        for s in range(9):
            place(filters[s % 3], s, 0, home)
            await until(lambda s=s: all(len(f.sessions) == s + 1 for f in filters))
        assert sorted(home.values()) == sorted("aaabbbccc")  # as one picker would place them
        assert f0.sessions.counts() == f1.sessions.counts() == f2.sessions.counts()
        # A later turn at another replica than the one that placed the session's last turn:
        # recognised (no new session counted), and its home comes from the peer's record.
        for s in range(9):
            f = filters[(s + 1) % 3]
            r = turn(s, 1)
            cands = [cand(a, prefix=held(s, 0) if a == home[s] else len(SHARED)) for a in "abc"]
            assert f.home(r, cands) == home[s]
            f.observe(r, cands, Decision(endpoints=(cand(home[s]).endpoint,)))
        await until(lambda: s0.stats.applied >= 12 and s1.stats.applied >= 12)
        await until(lambda: all(f.sessions.counts() == {"a": 3, "b": 3, "c": 3} for f in filters))
        assert all(len(f.sessions) == 9 for f in filters)

        # A replica that starts now reads the session window from the stream.
        async with replica(redis_server.url, "r3") as (f3, _):
            await until(lambda: f3.sessions.counts() == {"a": 3, "b": 3, "c": 3})
        # The stream stays bounded (trimmed at each write, about max_entries).
        client = Redis.from_url(redis_server.url)
        try:
            assert 0 < await client.xlen("extproc:sessions") <= 40
        finally:
            await client.aclose()


async def test_redis_outage_degrades_to_own_record_says_so_and_heals(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="extproc.server.shared_sessions")
    async with (
        replica(redis_server.url, "r0") as (f0, s0),
        replica(redis_server.url, "r1") as (f1, s1),
    ):
        home: dict[int, str] = {}
        place(f0, 0, 0, home)
        await until(lambda: len(f1.sessions) == 1)
        redis_server.kill()
        await until(lambda: s0.is_degraded and s1.is_degraded)
        # Placing goes on, on each replica's own record.
        place(f1, 1, 0, home)
        assert len(f1.sessions) == 2 and len(f0.sessions) == 1
        errors = s0.stats.errors
        await until(lambda: s0.stats.errors > errors + 2)
        redis_server.start()
        # Back: the placement queued during the outage reaches the peer.
        await until(lambda: not s0.is_degraded and not s1.is_degraded)
        await until(lambda: len(f0.sessions) == 2)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("exchange failed" in m for m in messages) == 2  # once per replica
    assert sum("back after" in m for m in messages) == 2


async def test_stray_stream_entries_are_counted_on_metrics_and_said_once(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Entries on the sessions stream that are no replica's (garbage, a wrong shape): skipped,
    counted in extproc_shared_sessions_bad_entries, one warning line (rate-limited)."""
    from extproc.server.families import SHARED_SESSIONS

    caplog.set_level(logging.WARNING, logger="extproc.server.shared_sessions")
    async with (
        replica(redis_server.url, "a") as (_f, shared),
        Redis.from_url(redis_server.url) as raw,
    ):
        await asyncio.sleep(0.3)  # reading from the stream's end
        # Garbage, wrong shapes, and placements whose first-turn length no turn has or
        # whose class is no class's name.
        forged = [
            msgpack.encode(["b", [["0", [], "s", [1], first]]]) for first in (-1, 1 << 40, "3")
        ] + [msgpack.encode(["b", [["0", [], "s", [1], 3, cls]]]) for cls in (7, "x" * 65)]
        for blob in (b"\xc1 not msgpack", b"\x92\xa1b\x01", b"\x92\xa1b\x91\x01", *forged):
            await raw.xadd("extproc:sessions", {"d": blob})
        await until(lambda: shared.stats.bad_entries == 8)
        assert len(_f.sessions) == 0
        fam = next(
            f for f in SHARED_SESSIONS.families(shared.stats) if f.name.endswith("bad_entries")
        )
        assert fam.samples[0].value == 8
    lines = [r.getMessage() for r in caplog.records if "stream entry skipped" in r.getMessage()]
    assert len(lines) == 1, lines


async def test_a_first_turns_class_travels_so_a_peers_continuation_counts_for_it(
    redis_server: RedisServer,
) -> None:
    """`uncontinuedPrior` per class: a session started at one replica with tools declared and
    continued at the other counts as come back for `chat+tools` at both (scheduling/plugins/
    session_classes.py), and for no other class."""
    params = BoundedSessionsFilter.Params(epsilon=0.0, uncontinued_prior=True)
    async with (
        replica(redis_server.url, "r0", params) as (f0, _),
        replica(redis_server.url, "r1", params) as (f1, _),
    ):
        tools = Prompt(tools=(b'{"type": "function", "function": {"name": "run"}}',))
        first, nxt = (dataclasses.replace(turn(0, n), prompt=tools) for n in (0, 1))
        cands = [cand(a, prefix=0) for a in "abc"]
        f0.observe(first, cands, Decision(endpoints=(cand("a").endpoint,)))
        await until(lambda: len(f1.sessions) == 1)
        cands = [cand(a, prefix=held(0, 0) if a == "a" else 0) for a in "abc"]
        assert f1.home(nxt, cands) == "a"
        f1.observe(nxt, cands, Decision(endpoints=(cand("a").endpoint,)))
        assert f1.sessions.sessions_come_back("chat+tools") is True
        await until(lambda: f0.sessions.sessions_come_back("chat+tools") is True)
        assert f0.sessions.sessions_come_back("chat") is None
        assert f0.sessions.unclassed_continued == f1.sessions.unclassed_continued == 0
