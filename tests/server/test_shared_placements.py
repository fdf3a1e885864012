"""Two replicas' `predicted-ttft-scorer`s share their placements through real Redis: a
placement made on one queues prefill and fills the cache in the other's view (and so moves
its scores); forged or garbage placements are refused or clamped; a replica whose Redis is
gone says so (metric, counters) and keeps its own view."""

from __future__ import annotations

import asyncio
import logging

import msgspec
import pytest
import redis.asyncio

from extproc.core import Decision
from extproc.scheduling.plugins.ttft import _MAX_QUEUE_S, PredictedTTFTScorer
from extproc.server.shared_placements import SharedPlacements
from tests.scheduling.helpers import cand, req
from tests.server.broadcasting import running, until


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def _place(scorer: PredictedTTFTScorer, r, cands, addr: str) -> None:
    chosen = next(c for c in cands if c.endpoint.address == addr)
    scorer.observe(r, cands, Decision(endpoints=(chosen.endpoint,)))


def _pair(url: str, clock: Clock, **kw):
    a_sc, b_sc = PredictedTTFTScorer(clock=clock), PredictedTTFTScorer(clock=clock)
    a = SharedPlacements.from_url(url, SharedPlacements.scorers([a_sc]), process_id="a", **kw)
    b = SharedPlacements.from_url(url, SharedPlacements.scorers([b_sc]), process_id="b", **kw)
    return a_sc, b_sc, a, b


async def test_a_placement_on_one_replica_queues_and_fills_in_the_others_view(redis_server):
    clock = Clock()
    a_sc, b_sc, a, b = _pair(redis_server.url, clock)
    cands = [cand("s0", prefill_tps=6400.0), cand("s1", prefill_tps=6400.0)]
    probe = req(blocks=100, tokens=6400)
    assert b_sc.score(probe, cands) == [1.0, 1.0]
    async with running(a, b):
        await asyncio.sleep(0.3)  # both subscribed
        # Replica a places 12,800 uncached tokens (2 s of prefill) on s0.
        _place(a_sc, req(blocks=200, tokens=12_800), cands, "s0")
        await until(lambda: b.stats.applied == 1, "b folds a's placement")
        # b never placed anything, yet sees s0's queue (2 s, dated by its wait in a's batch:
        # the clock here stands still, so at most the 50 ms batch interval less) and its
        # written tokens, and steers the probe away from s0.
        (queue, written) = b_sc.view()["s0"]
        assert 1.9 <= queue <= 2.0 and written == 12_800
        s = b_sc.score(probe, cands)
        assert s[1] == 1.0 and s[0] < 0.5
        # And back: b's placement on s1 reaches a; a's own is not echoed to itself.
        _place(b_sc, req(blocks=100, tokens=6400), cands, "s1")
        await until(lambda: a.stats.applied == 1, "a folds b's placement")
        assert a_sc.view()["s1"][1] == 6400 and a_sc.view()["s0"][1] == 12_800
    assert a.stats.published == 1 and b.stats.published == 1
    assert a.stats.bad_entries == b.stats.bad_entries == 0


async def test_written_tokens_shared_make_the_eviction_cost_start_on_every_replica(redis_server):
    clock = Clock()
    a_sc, b_sc, a, b = _pair(redis_server.url, clock)
    # 64 blocks x 16 tokens: 1,024 tokens of cache per server.
    full = [cand(x, prefill_tps=1000.0, kv_blocks=64, kv_block_size=16) for x in ("s0", "s1")]
    async with running(a, b):
        await asyncio.sleep(0.3)
        # Replica a fills s0's cache (and learns that prompts are reused).
        for _ in range(3):
            _place(a_sc, req(blocks=40, tokens=640), [full[0]], "s0")
        for _ in range(20):
            _place(a_sc, req(blocks=40, tokens=640), [cand("s0", prefix=39)], "s0")
        await until(lambda: b.stats.applied == 23, "b folds every placement")
    clock.t += 60  # queues drained: only the eviction cost differs
    r = req(blocks=40, tokens=640)
    # Both replicas now charge s0 (full) for the evictions a cold prompt causes, not s1.
    assert a_sc.eviction_cost(r, full[0]) > 0 and a_sc.eviction_cost(r, full[1]) == 0
    assert b_sc.eviction_cost(r, full[0]) == pytest.approx(a_sc.eviction_cost(r, full[0]))
    assert b_sc.eviction_cost(r, full[1]) == 0


async def test_forged_placements_are_refused_or_clamped(redis_server, caplog):
    caplog.set_level(logging.WARNING, logger="extproc.server.shared_placements")
    clock = Clock()
    sc = PredictedTTFTScorer(clock=clock)
    shared = SharedPlacements.from_url(
        redis_server.url, SharedPlacements.scorers([sc]), process_id="a",
        known=lambda address: address == "s1",
    )  # fmt: skip
    bad = [
        "not a pair",
        [0.0, ["0", "s9", 100.0, 100, 0.1]],  # a server not in the pool
        [0.0, ["7", "s1", 100.0, 100, 0.1]],  # no such scorer
        [0.0, ["0", "s1", float("nan"), 100, 0.1]],
        [0.0, ["0", "s1", 100.0, 100, float("inf")]],
        [0.0, ["0", "s1", -5.0, 100, 0.1]],
        [0.0, ["0", "s1", 500.0, 100, 0.1]],  # more uncached than the prompt
        [0.0, ["0", "s1", 1e12, 10**12, 0.1]],  # no prompt is that long
        [0.0, ["0", "s1", 100.0, 100, 1e9]],  # no prefill is that long
        [0.0, ["0", "s1", "x", 100, 0.1]],
        [0.0, ["0", 5, 100.0, 100, 0.1]],
    ]
    # Accepted, each within bounds, together past the queue bound: clamped there.
    good = [[0.0, ["0", "s1", 1000.0, 1000, _MAX_QUEUE_S]] for _ in range(3)]
    async with running(shared):
        await asyncio.sleep(0.3)
        client = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            await client.publish("extproc:placements", b"not msgpack \xc1")
            await client.publish("extproc:placements", msgspec.msgpack.encode(["b", bad + good]))
        finally:
            await client.aclose()
        await until(lambda: shared.stats.applied == 3, "the valid placements")
    assert shared.stats.bad_entries == 1 + len(bad)
    # Said, rate-limited: one line per reason (undecodable message, malformed item, and the
    # three refusals after decoding), not one per forged item.
    lines = [r.getMessage() for r in caplog.records if r.name.endswith("shared_placements")]
    assert len(lines) == 5, lines
    assert sum("refused (figures out of bounds)" in m for m in lines) == 1
    view = sc.view()
    assert view.keys() == {"s1"}  # nothing refused left state
    queue, written = view["s1"]
    assert queue == _MAX_QUEUE_S and written == 3000.0


async def test_redis_gone_is_said_and_the_replica_keeps_its_own_view(redis_server):
    clock = Clock()
    # The in-flight floor that is left out while the fleet's placements arrive is taken
    # with `inflightFloor: untilEnd` (the default, `drained`, takes none either way).
    until_end = PredictedTTFTScorer.Params(inflight_floor="untilEnd")
    sc = PredictedTTFTScorer(until_end, clock=clock)
    shared = SharedPlacements.from_url(
        redis_server.url, SharedPlacements.scorers([sc]), process_id="a"
    )
    cands = [cand("s0", prefill_tps=1000.0)]
    # 2 s of prefill in flight on s1 (any replica's): left out while the fleet's placements
    # arrive, taken again while they do not.
    probe = req(blocks=10, tokens=1000)
    floor = [cand("s1", prefill_tps=1000.0, inflight_tokens=2000)]
    async with running(shared):
        await asyncio.sleep(0.3)
        assert not shared.is_degraded
        assert sc.predict(probe, floor[0], clock.t) < 1.1
        redis_server.kill()
        _place(sc, req(blocks=10, tokens=500), cands, "s0")
        await until(lambda: shared.is_degraded, "degraded")
        await until(lambda: shared.stats.dropped == 1, "the placement counted as dropped")
        assert shared.stats.errors >= 1
        assert sc.view()["s0"] == (0.5, 500.0)  # its own placement still counts
        assert sc.predict(probe, floor[0], clock.t) > 2.9
        redis_server.start()
        await until(lambda: not shared.is_degraded, "recovered after Redis came back")
