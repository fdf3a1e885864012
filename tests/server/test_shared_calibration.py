"""Replicas pool approximate mode's calibration through real Redis: one replica's placements
fill another's windows, a confirmed change is adopted by the peers and read by a replica
that starts later, forged values are counted and ignored, and a replica whose Redis is gone
says so and calibrates on its own."""

from __future__ import annotations

import asyncio

import msgspec
import orjson
import redis.asyncio

from extproc.calibration import Calibration
from extproc.requests.settings import ParseSettings
from extproc.server.shared_calibration import SharedCalibration
from tests.server.broadcasting import running, until

BODY = orjson.dumps({"model": "m", "prompt": "x" * 4000})  # 1,000 tokens at 4 per token


def _cal() -> Calibration:
    return Calibration(ParseSettings(bytes_per_token=4))


def _shared(url: str, cal: Calibration, pid: str) -> SharedCalibration:
    return SharedCalibration.from_url(
        url, cal, process_id=pid, known=lambda address: address == "s1"
    )


def _learn(cal: Calibration) -> None:
    """Two windows of 32 requests placed here on server s1, each request 2,000 engine
    tokens (2 characters a token for BODY's 4,000): a confirmed change to 2."""
    req = cal("/v1/completions", {}, BODY)
    at, done = 0, (0.0, 0.0)
    cal.observe("s1", None, at, done)
    for _ in range(2):
        for _ in range(32):
            cal.placed("s1", req)
        at, done = at + 64_000, (done[0] + 64_000, done[1] + 32)
        cal.observe("s1", None, at, done)


async def test_a_replica_that_placed_nothing_calibrates_from_its_peers_placements(redis_server):
    a, b = _cal(), _cal()
    sa, sb = _shared(redis_server.url, a, "a"), _shared(redis_server.url, b, "b")
    async with running(sa, sb):
        await asyncio.sleep(0.3)  # both subscribed
        for cal in (a, b):
            cal.observe("s1", None, 0, (0.0, 0.0))
        req = a("/v1/completions", {}, BODY)
        for _ in range(32):
            a.placed("s1", req)
        await until(lambda: sb.stats.applied == 32, "a's placements on b")
        # Both scrape the engine: its first window closes on both, with a's placements.
        a.observe("s1", None, 64_000, (64_000.0, 32.0))
        b.observe("s1", None, 64_000, (64_000.0, 32.0))
        assert a.stats.ratios["s1"] == b.stats.ratios["s1"] == 2.0
        for _ in range(32):
            a.placed("s1", req)
        await until(lambda: sb.stats.applied == 64, "the second window's placements")
        # b closes its second window first: its own confirmed change, announced to a.
        b.observe("s1", None, 128_000, (128_000.0, 64.0))
        assert b.settings.bytes_per_token == 2 and b.stats.adopted == 0
        await until(lambda: a.settings.bytes_per_token == 2, "a adopts b's value")
        assert a.stats.adopted == 1 and a.settings.key_bytes_per_token == 4
        assert sa.stats.adopted == 1
        # a never announces what it adopted: b hears nothing back.
        await asyncio.sleep(0.2)
        assert sb.stats.adopted == 0 and b.stats.changes == 1


async def test_a_peers_request_joins_the_pairing_here_once_it_completed(redis_server):
    # a learns its requests' ends: its placements reach b as waiting for their end, and b
    # pairs one only once a tells it completed; a cut one never joins b's queue.
    a, b = _cal(), _cal()
    a.ends_known = lambda: True
    sa, sb = _shared(redis_server.url, a, "a"), _shared(redis_server.url, b, "b")
    long = orjson.dumps({"model": "m", "prompt": "x" * 8000})  # 2,000 tokens at 4 per token
    async with running(sa, sb):
        await asyncio.sleep(0.3)  # both subscribed
        for cal in (a, b):
            cal.observe("s1", None, 0, (0.0, 0.0))
        for i in range(8):
            a.placed("s1", a("/v1/completions", {"x-request-id": f"cut{i}"}, BODY))
            a.placed("s1", a("/v1/completions", {"x-request-id": f"done{i}"}, long))
        await until(lambda: sb.stats.applied == 16, "a's placements on b")
        for i in range(8):
            a.ended(f"cut{i}", False)
            a.ended(f"done{i}", True)
        await until(lambda: sb.stats.completed == 8, "the completed ones on b")
        # The engine counted the 8 completed ones, 4,000 tokens each: b pairs them with
        # their own placements (paired in placement order: half of them cut ones, 2.67).
        for cal in (a, b):
            cal.observe("s1", None, 32_000, (32_000.0, 8.0))
        assert a.stats.ratios["s1"] == b.stats.ratios["s1"] == 2.0
        assert sa.stats.completed == 0 and a.stats.cut == 8 and b.stats.cut == 0


async def test_a_replica_starting_later_reads_the_fleets_value(redis_server):
    a = _cal()
    sa = _shared(redis_server.url, a, "a")
    async with running(sa):
        await asyncio.sleep(0.3)
        _learn(a)
        assert a.settings.bytes_per_token == 2
        client = redis.asyncio.Redis.from_url(redis_server.url)
        try:

            async def written() -> bytes | None:
                return await client.get("extproc:calibration")

            for _ in range(100):
                if await written() is not None:
                    break
                await asyncio.sleep(0.05)
            assert msgspec.msgpack.decode(await written()) == [2, 4]
            assert 0 < await client.ttl("extproc:calibration") <= 86_400
        finally:
            await client.aclose()
    # Later, with nothing said on the channel any more: c starts calibrated.
    c = _cal()
    sc = _shared(redis_server.url, c, "c")
    async with running(sc):
        await until(lambda: c.settings.bytes_per_token == 2, "c reads the fleet's value")
    assert c.stats.adopted == 1 and sc.stats.adopted == 1 and c.settings.key_bytes_per_token == 4


async def test_forged_values_are_counted_and_ignored(redis_server):
    cal = _cal()
    shared = _shared(redis_server.url, cal, "a")
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        # A value for other keys in the fleet's key: refused at start.
        await client.set("extproc:calibration", msgspec.msgpack.encode([1, 3]))
        async with running(shared):
            await until(lambda: cal.stats.refused == 1, "the key's value refused")
            await asyncio.sleep(0.5)  # subscribed
            items = [
                ["c", 0, 4],  # below one byte a token
                ["c", 99, 4],  # above the bounds
                ["c", 2.5, 4],  # not an integer: a bad entry
                ["e", "s9", 1000, 4],  # a server outside the pool
                ["e", "s1", -5, 4],  # a negative estimate
                ["e", "s1", 10**9, 4],  # no prompt is that long
                ["e", "s1", 1000, 0],  # no tokenizer has 0 bytes a token
                ["e", "s1", 1000, 4, 1001],  # more media than tokens
                ["x", 1, 2],  # an unknown kind
                ["e", "s1", 1000, 4, 0, 1],  # waiting for its end: not a boolean
                ["d", "s9", 1000, 4, 0, 100],  # completed: a server outside the pool
                ["d", "s1", 1000, 4, 0, -1],  # placed in the future
                ["d", "s1", 1000, 4, 0, 10**8],  # forgotten long before
                ["d", "s1", 1000, 4],  # fields missing
                ["e", "s1", 1000, 4],  # a good item (a replica of before media were sent)
                ["e", "s1", 1000, 4, 768],  # and one with its media (before ends were told)
                ["e", "s1", 1000, 4, 768, True],  # and one waiting for its end
                ["d", "s1", 1000, 4, 768, 2500],  # which completed 2.5 s after placement
            ]
            await client.publish("extproc:calibration", b"\xc1 not msgpack")  # first: in order
            await client.publish("extproc:calibration", msgspec.msgpack.encode(["b", items]))
            await until(lambda: shared.stats.completed == 1, "the good items applied")
    finally:
        await client.aclose()
    assert cal.stats.refused == 3 and cal.stats.changes == 0 and cal.stats.adopted == 0
    assert cal.settings.bytes_per_token == 4
    assert shared.stats.applied == 3
    assert shared.stats.bad_entries == 13 and shared.stats.adopted == 0


async def test_redis_gone_is_said_and_calibration_goes_on_locally(redis_server, caplog):
    cal = _cal()
    shared = _shared(redis_server.url, cal, "a")
    async with running(shared):
        await asyncio.sleep(0.3)
        assert not shared.is_degraded
        redis_server.kill()
        _learn(cal)
        # This replica's own windows still calibrate it.
        assert cal.settings.bytes_per_token == 2
        await until(lambda: shared.is_degraded, "degraded")
        await until(lambda: shared.stats.dropped > 0, "placements counted as dropped")
        assert shared.stats.errors >= 1
        assert "shared calibration: Redis failing" in caplog.text
        redis_server.start()
        await until(lambda: not shared.is_degraded, "recovered after Redis came back")
        client = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            # The change made while Redis was gone reaches the key once it answers.
            for _ in range(100):
                if await client.get("extproc:calibration") is not None:
                    break
                await asyncio.sleep(0.05)
            raw = await client.get("extproc:calibration")
        finally:
            await client.aclose()
    assert raw is not None and msgspec.msgpack.decode(raw) == [2, 4]
