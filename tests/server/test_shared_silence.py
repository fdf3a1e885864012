"""Two replicas judge KV-event silence fleet-wide through real Redis (server/shared_silence.py):
what one hears reaches the other's watch, the in-flight exchange brings the other's
placements, forged counts are refused, and with Redis gone each replica says so (degraded,
a log line) and judges from its own tally."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import redis.asyncio

from extproc.endpoints.shared_inflight import SharedInFlight, SharedInFlightSettings
from extproc.index.silence import SilenceWatch
from extproc.server.shared_silence import SharedSilence
from tests.server.broadcasting import running, until

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
FAST = SharedInFlightSettings(interval_s=0.02, ttl_s=0.5, timeout_s=0.2, max_backoff_s=0.1)


@dataclass(frozen=True)
class Replica:
    watch: SilenceWatch
    shared: SharedSilence
    inflight: SharedInFlight

    def place(self, address: str) -> None:
        """A placement as the router makes it: counted in flight and by the watch."""
        self.inflight.acquire(address, 10)
        self.watch.placed(address)

    def fleet_pending(self, address: str) -> int:
        self.watch.check()
        return self.watch.view(address).unanswered


@contextlib.asynccontextmanager
async def replica(url: str, name: str) -> AsyncIterator[Replica]:
    """One replica's watch, its in-flight exchange and its heard-count channel, running."""
    inflight = SharedInFlight.from_url(url, settings=FAST, process_id=name)
    watch = SilenceWatch(every_s=0.1, judge_unheard=False)
    shared = SharedSilence.from_url(
        url,
        watch,
        process_id=name,
        peers_ok=lambda: not inflight.is_degraded,
        peers=inflight.peers,
        known=lambda address: address in (A, B),
    )
    inflight.on_peer_placed = shared.peer_placed
    async with running(inflight, shared):
        yield Replica(watch, shared, inflight)


async def test_what_one_replica_hears_and_places_reaches_the_others_judging(redis_server):
    async with replica(redis_server.url, "a") as a, replica(redis_server.url, "b") as b:
        await asyncio.sleep(0.3)  # both subscribed, both in the exchange
        # Replica a places on B; b, which placed nothing, counts them (the in-flight exchange).
        for _ in range(3):
            a.place(B)
        await until(lambda: b.fleet_pending(B) == 3, "b counts a's placements")
        assert b.watch.judging_fleet and not b.shared.is_degraded
        # a hears B's publisher; b learns it within a check: B is answered there too.
        a.watch.heard(B)
        await until(lambda: b.shared.stats.applied == 1, "b applies a's heard count")
        assert b.fleet_pending(B) == 0
        assert a.shared.stats.published >= 1 and a.shared.stats.applied == 0  # not echoed


async def test_a_live_peer_that_shares_no_heard_counts_makes_each_replica_judge_alone(
    redis_server, caplog
):
    # An older version's replica during a rolling upgrade: in the exchange, no heard counts.
    caplog.set_level(logging.WARNING)
    old = SharedInFlight.from_url(redis_server.url, settings=FAST, process_id="old")
    async with replica(redis_server.url, "a") as a, running(old):
        await until(lambda: "old" in a.inflight.peers(), "a sees the old peer")
        for _ in range(3):
            old.acquire(B, 10)
        await until(lambda: a.shared.stats.unshared == 3, "its placements left out")
        assert a.shared.is_degraded
        a.watch.check()
        assert not a.watch.judging_fleet and a.watch.view(B).unanswered == 0

        def said() -> bool:
            a.watch.check()  # asks whether the fleet's news is whole
            return any("peer old sends no heard counts" in r.getMessage() for r in caplog.records)

        await until(said, "said once its grace is over")
    # With only sharing peers, the fleet judges again (the old one withdrew on close).
    async with replica(redis_server.url, "a2") as a2, replica(redis_server.url, "b2") as b2:
        await until(
            lambda: {"b2", "a2"} <= a2.inflight.peers() | b2.inflight.peers(), "both exchanging"
        )
        await until(lambda: not a2.shared.is_degraded and not b2.shared.is_degraded, "fleet")


async def test_forged_heard_counts_are_refused(redis_server, caplog):
    async with replica(redis_server.url, "b") as b:
        await asyncio.sleep(0.3)
        client = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            bad = {"10.9.9.9:1": 1, A: -3, B: 2.5}
            for blob in ([["x", [bad]]], [["x", [[1, 2]]]]):
                await client.publish("extproc:kv-heard", msgspec.msgpack.encode(blob[0]))
            await until(lambda: b.shared.stats.bad_entries >= 4, "forged counts refused")
        finally:
            await client.aclose()
        assert b.shared.stats.applied == 0


async def test_redis_gone_is_said_and_silence_is_judged_per_replica(redis_server, caplog):
    caplog.set_level(logging.WARNING)
    async with replica(redis_server.url, "a") as a:
        await asyncio.sleep(0.3)
        a.watch.check()
        assert a.watch.judging_fleet and not a.shared.is_degraded
        redis_server.kill()
        await until(lambda: a.shared.is_degraded, "degraded")
        a.watch.check()
        assert not a.watch.judging_fleet
        assert any("each replica judges" in r.getMessage() for r in caplog.records)
        redis_server.start()
        await until(lambda: not a.shared.is_degraded, "recovered after Redis came back")
        await until(lambda: a.fleet_pending(A) == 0 and a.watch.judging_fleet, "fleet again")
