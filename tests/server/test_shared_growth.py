"""Two replicas' `bounded-sessions-filter`s share learned session growth through a real
redis-server: what one learns from a continued session keeps the other's next new session on
the same prefix together (where it would be bounded for want of growth); forged or garbled
records are refused and counted; a replica whose Redis is gone says so (metric, counters)
and keeps learning on its own."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import msgspec
import redis.asyncio

from extproc.core import Decision, InferenceRequest
from extproc.scheduling.plugins.sessions import BoundedSessionsFilter
from extproc.server.shared_growth import _MAX_KEYS, SharedGrowth
from extproc.testing import ManualClock
from tests.redis_servers import RedisServer
from tests.scheduling.helpers import cand, req
from tests.server.broadcasting import running, until

HEADER = tuple(range(1, 9))  # every tenant's first blocks (a chat template's header)
SHARING = BoundedSessionsFilter.Params(share_growth=True)


def chat(tenant: int, conv: int, turn: int, prompt_blocks: int = 24) -> InferenceRequest:
    """Turn `turn` of a conversation: the header, the tenant's prompt, 2 blocks a turn."""
    prompt = HEADER + tuple(100_000 * (tenant + 1) + i for i in range(prompt_blocks))
    own = tuple(100_000 * (tenant + 1) + 1000 * (conv + 1) + i for i in range(2 * (turn + 1)))
    return dataclasses.replace(req(tokens=64 * (len(prompt) + len(own))), block_keys=prompt + own)


def converse(f: BoundedSessionsFilter, tenant: int, conv: int, prompt_blocks: int = 24) -> None:
    """A conversation's two turns placed on "a" by `f` (its replica learns its growth)."""
    first = chat(tenant, conv, 0, prompt_blocks)
    cands = [cand(x, prefix=len(HEADER)) for x in "ab"]
    f.observe(first, cands, Decision(endpoints=(cand("a").endpoint,)))
    nxt = chat(tenant, conv, 1, prompt_blocks)
    cands = [cand("a", prefix=len(first.block_keys)), cand("b")]
    assert f.continues(nxt, cands)
    f.observe(nxt, cands, Decision(endpoints=(cand("a").endpoint,)))


def new_session(f: BoundedSessionsFilter, tenant: int) -> None:
    """A new conversation of `tenant` through `f`'s filter: "a" holds the tenant's prompt
    (an earlier conversation of it went there)."""
    f.filter(chat(tenant, 9, 0), [cand("a", prefix=len(HEADER) + 24), cand("b")])


def pair(
    url: str,
) -> tuple[BoundedSessionsFilter, BoundedSessionsFilter, SharedGrowth, SharedGrowth]:
    fa, fb = BoundedSessionsFilter(SHARING), BoundedSessionsFilter(SHARING)
    a = SharedGrowth.from_url(url, SharedGrowth.records([fa]), process_id="a")
    b = SharedGrowth.from_url(url, SharedGrowth.records([fb]), process_id="b")
    return fa, fb, a, b


async def test_growth_learned_on_one_replica_keeps_the_others_new_sessions_together(
    redis_server: RedisServer,
) -> None:
    fa, fb, a, b = pair(redis_server.url)
    async with running(a, b):
        await asyncio.sleep(0.3)  # both subscribed
        # Before anything is learned anywhere, b bounds a new conversation: growth unknown.
        new_session(fb, 1)
        assert fb.stats.growth_unknown == 1
        # Replica a sees one of tenant 0's conversations continued (2 blocks past its first
        # turn); b never placed a turn of it, yet reads the growth under the shared header,
        # and keeps tenant 1's next conversation with the header's holder.
        converse(fa, 0, 0)
        await until(lambda: b.stats.applied >= 1, "b merges a's record")
        new_session(fb, 1)
        assert fb.stats.kept_together == 1 and fb.stats.growth_unknown == 1
        # A long first turn's records (one per 8 blocks, plus the first 7) go out in items
        # of at most `_MAX_KEYS` keys; b merges them all.
        converse(fa, 2, 0, prompt_blocks=3000)
        first = chat(2, 0, 0, 3000).block_keys
        await until(lambda: b.stats.applied >= 3, "b merges both parts of the long record")
        assert len(first) // 8 + 7 > _MAX_KEYS
        assert fb.sessions.learned(first, len(first)) == (2, len(first) // 8 * 8)
    assert a.stats.published == 3 and b.stats.published == 0
    assert a.stats.bad_entries == b.stats.bad_entries == 0
    # On by default; without the option no record is handed to a channel.
    assert SharedGrowth.records([BoundedSessionsFilter()]).keys() == {"0"}
    off = BoundedSessionsFilter.Params(share_growth=False)
    assert SharedGrowth.records([BoundedSessionsFilter(off)]) == {}


async def test_forged_growth_records_are_refused_and_counted(
    redis_server: RedisServer, caplog
) -> None:
    caplog.set_level(logging.WARNING, logger="extproc.server.shared_growth")
    f = BoundedSessionsFilter(SHARING)
    shared = SharedGrowth.from_url(redis_server.url, SharedGrowth.records([f]), process_id="a")
    bad = [
        "not a triple",
        ["0", 3],  # too short
        ["7", 3, [1, 2]],  # no such filter
        [0, 3, [1, 2]],  # a name that is no string
        ["0", -1, [1, 2]],
        ["0", 1 << 30, [1, 2]],  # no session grows that much
        ["0", 2.5, [1, 2]],
        ["0", True, [1, 2]],
        ["0", 3, []],
        ["0", 3, list(range(1, _MAX_KEYS + 2))],  # more keys than a record carries
        ["0", 3, [1, -2]],
        ["0", 3, [1, 2.0]],
        ["0", 3, [1, "2"]],
        ["0", 3, "12"],
    ]
    good = [["0", 3, list(HEADER)]]
    async with running(shared):
        await asyncio.sleep(0.3)
        client = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            await client.publish("extproc:growth", b"not msgpack \xc1")
            await client.publish("extproc:growth", msgspec.msgpack.encode(["b", bad + good]))
        finally:
            await client.aclose()
        await until(lambda: shared.stats.applied == 1, "the valid record")
        await until(lambda: shared.stats.bad_entries == 1 + len(bad), "every forged one counted")
    # Said, rate-limited: one line per reason (undecodable message, malformed items, and the
    # three refusals after decoding), not one per forged record.
    lines = [r.getMessage() for r in caplog.records if r.name.endswith("shared_growth")]
    assert len(lines) == 5, lines
    # Only the valid record was merged (not the forged one's keys past the header's).
    assert f.sessions.learned(chat(0, 0, 0).block_keys, len(HEADER)) == (3, len(HEADER))
    assert f.sessions.learned(tuple(range(100, 108)), 8) is None


async def test_redis_gone_is_said_and_the_replica_learns_on_its_own(
    redis_server: RedisServer,
) -> None:
    f = BoundedSessionsFilter(SHARING)
    shared = SharedGrowth.from_url(redis_server.url, SharedGrowth.records([f]), process_id="a")
    async with running(shared):
        await asyncio.sleep(0.3)
        assert not shared.is_degraded
        redis_server.kill()
        converse(f, 0, 0)
        await until(lambda: shared.is_degraded, "degraded")
        await until(lambda: shared.stats.dropped == 1, "the record counted as dropped")
        assert shared.stats.errors >= 1
        # Its own learning goes on: the next conversation on the header is kept together.
        new_session(f, 1)
        assert f.stats.kept_together == 1 and f.stats.growth_unknown == 0
        redis_server.start()
        await until(lambda: not shared.is_degraded, "recovered after Redis came back")


async def test_a_first_turn_nothing_continued_teaches_the_peers_too(
    redis_server: RedisServer,
) -> None:
    """Issue 14, twenty-third session: replica a places a one-shot group's first request;
    no later turn comes within the horizon, so a records growth 0 and publishes it, and b,
    which placed nothing of the group, keeps the group's next repeat with the holder."""
    clock = ManualClock()
    fa, fb = BoundedSessionsFilter(SHARING, clock=clock), BoundedSessionsFilter(SHARING)
    a = SharedGrowth.from_url(redis_server.url, SharedGrowth.records([fa]), process_id="a")
    b = SharedGrowth.from_url(redis_server.url, SharedGrowth.records([fb]), process_id="b")
    async with running(a, b):
        await asyncio.sleep(0.3)  # both subscribed
        first = chat(0, 0, 0)
        fa.observe(first, [cand("a"), cand("b")], Decision(endpoints=(cand("a").endpoint,)))
        clock.advance(fa.sessions.uncontinued_horizon() or 0.0)
        fa.sessions.settle()
        assert fa.stats.uncontinued_learned == 1
        await until(lambda: b.stats.applied >= 1, "b merges a's 0 record")
        new_session(fb, 0)
        assert fb.stats.kept_together == 1 and fb.stats.growth_unknown == 0, fb.stats
