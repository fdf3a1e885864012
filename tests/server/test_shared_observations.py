"""Two replicas share what they learn through real Redis: a prefill-speed sample taken on
one shows in the other's estimate, a new-prefix pick made on one moves the other's LRU, and
a replica whose Redis is gone says so (metric, counters) and keeps learning on its own."""

from __future__ import annotations

import asyncio

import msgspec
import redis.asyncio

from extproc.core import Candidate, Decision, Endpoint, EndpointState, InferenceRequest
from extproc.endpoints.prefill_speed import PrefillSpeeds
from extproc.scheduling.plugins.prefix import NoHitLRUScorer
from extproc.server.families import SHARED_OBSERVATIONS
from extproc.server.shared_observations import SharedObservations
from tests.server.broadcasting import running, until


def _cands(addresses: list[str]) -> list[Candidate]:
    return [Candidate(Endpoint(a), EndpointState(), prefix_blocks=0.0) for a in addresses]


async def test_a_speed_sample_taken_on_one_replica_reaches_the_other(redis_server):
    a_speeds, b_speeds = PrefillSpeeds(), PrefillSpeeds()
    a = SharedObservations.from_url(redis_server.url, a_speeds, {}, process_id="a")
    b = SharedObservations.from_url(redis_server.url, b_speeds, {}, process_id="b")
    async with running(a, b):
        await asyncio.sleep(0.3)  # both subscribed
        a_speeds.observe("s1", 4000, 0.5)  # 8,000 tok/s, placed and ended on replica a
        await until(lambda: b_speeds.get("s1") is not None, "b learns s1's speed")
        assert b_speeds.get("s1") == a_speeds.get("s1") == 8000.0
        # b's own sample and a's are one window on both replicas: the same median.
        b_speeds.observe("s1", 6000, 0.5)  # 12,000
        b_speeds.observe("s1", 5000, 0.5)  # 10,000
        await until(lambda: a_speeds.get("s1") == 10000.0, "a sees b's samples")
        assert b_speeds.get("s1") == 10000.0
        assert a.stats.published == 1 and b.stats.applied == 1
        assert b.stats.published == 2 and a.stats.applied == 2


async def test_a_cold_pick_on_one_replica_steers_the_others_next_cold_pick(redis_server):
    addrs = ["s0", "s1", "s2"]
    a_lru, b_lru = NoHitLRUScorer(), NoHitLRUScorer()
    a = SharedObservations.from_url(
        redis_server.url, PrefillSpeeds(), SharedObservations.lru_scorers([a_lru]),
        process_id="a",
    )  # fmt: skip
    b = SharedObservations.from_url(
        redis_server.url, PrefillSpeeds(), SharedObservations.lru_scorers([b_lru]),
        process_id="b",
    )  # fmt: skip
    req = InferenceRequest("r", "/v1/chat/completions", block_keys=(1, 2))
    async with running(a, b):
        await asyncio.sleep(0.3)
        cands = _cands(addrs)
        a_lru.observe(req, cands, Decision(endpoints=(cands[0].endpoint,)))
        await until(lambda: a.stats.published == 1 and b.stats.applied == 1, "pick shared")
        # Replica b never placed a cold request itself, yet s0 is now its least preferred.
        assert b_lru.score(req, cands) == [0.0, 1.0, 1.0]
        b_lru.observe(req, cands, Decision(endpoints=(cands[1].endpoint,)))
        await until(lambda: a.stats.applied == 1, "b's pick back on a")
        assert a_lru.score(req, cands) == [0.9, 0.0, 1.0]


async def test_a_bad_message_an_unknown_server_or_scorer_is_skipped(redis_server, caplog):
    speeds, lru = PrefillSpeeds(), NoHitLRUScorer()
    shared = SharedObservations.from_url(
        redis_server.url, speeds, SharedObservations.lru_scorers([lru]), process_id="a",
        known=lambda address: address == "s1",
    )  # fmt: skip
    async with running(shared):
        await asyncio.sleep(0.3)
        client = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            await client.publish("extproc:observations", b"not msgpack \xc1")
            await client.publish("extproc:observations", msgspec.msgpack.encode([1, 2]))
            await client.publish(
                "extproc:observations",
                msgspec.msgpack.encode(
                    ["b", [["s", "s9", 100.0], ["s", "s1", 5000.0], ["p", "0", "s9"]]]
                ),
            )
            # A peer with a second no-hit-lru-scorer (another config): its picks for it; and
            # an item of a kind this version does not know.
            await client.publish(
                "extproc:observations",
                msgspec.msgpack.encode(["c", [["p", "1", "s1"], ["p", "1", "s1"], ["x", 1, 2]]]),
            )
        finally:
            await client.aclose()
        await until(lambda: speeds.get("s1") == 5000.0, "the known server's sample")
        await until(lambda: shared.stats.unknown_scorer == 2, "the other config's picks")
    assert shared.stats.bad_entries == 3  # two messages, and the item of no known kind
    assert shared.stats.applied == 1
    # Picks for a scorer this replica lacks: on /metrics and said once (rate-limited).
    fam = next(
        f for f in SHARED_OBSERVATIONS.families(shared.stats)
        if f.name == "extproc_shared_observations_unknown_scorer"
    )  # fmt: skip
    assert [s.value for s in fam.samples] == [2]
    said = [r for r in caplog.records if "no-hit-lru-scorer #1" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING"
    # Both items naming s9 (a sample and a pick) counted on /metrics, without a line.
    fam = next(
        f for f in SHARED_OBSERVATIONS.families(shared.stats)
        if f.name == "extproc_shared_observations_unknown_endpoint"
    )  # fmt: skip
    assert [s.value for s in fam.samples] == [2]
    assert not [r for r in caplog.records if "s9" in r.getMessage()]
    assert speeds.snapshot().keys() == {"s1"}  # the unknown server left no state
    # Neither the unknown server nor the other config's picks moved this replica's LRU.
    assert lru.score(InferenceRequest("r", "/"), _cands(["s1", "s9"])) == [1.0, 1.0]


async def test_redis_gone_is_said_and_learning_goes_on_locally(redis_server):
    speeds = PrefillSpeeds()
    shared = SharedObservations.from_url(redis_server.url, speeds, {}, process_id="a")
    async with running(shared):
        await asyncio.sleep(0.3)
        assert not shared.is_degraded
        redis_server.kill()
        speeds.observe("s1", 4000, 0.5)
        await until(lambda: shared.is_degraded, "degraded")
        await until(lambda: shared.stats.dropped == 1, "the sample counted as dropped")
        assert shared.stats.errors >= 1
        assert speeds.get("s1") == 8000.0  # this replica's own sample still counts
        redis_server.start()
        await until(lambda: not shared.is_degraded, "recovered after Redis came back")
