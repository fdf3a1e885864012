"""Placements shared between picker replicas: what each `predicted-ttft-scorer` placed where,
so every replica's virtual prefill queue and written-tokens count cover the whole fleet.

Behind one gateway each of N replicas places about 1/N of the requests. The scorer's queue
ahead of each server (its own placements' prefill, draining in real time) and its count of
tokens written into each server's cache (the eviction model: past the KV capacity, each new
token evicts one) then see a third of the work with three replicas: a server the fleet has
filled looks idle, its cache looks roomy. Each replica therefore publishes every placement
(server, uncached tokens, prompt tokens, prefill seconds) on a batched Redis pub/sub channel
(redis_broadcast.py, one PUBLISH per replica every `interval_s`), and folds the peers' in
as if it had made them, dated by how long each waited in its sender's batch.

On with `state.shared_placements: true` (off by default: the seventh session's interleaved
runs did not show TTFT p90 better with it). The hot path never touches Redis: a placement
is applied locally at once and queued. Peers' items are checked before they touch anything
(`PredictedTTFTScorer.fold`: servers of the pool only, finite, uncached within the prompt,
bounded prompt and prefill; a queue never predicted past a bound), so a forged message can
neither grow the state nor skew it without limit; a rejected item is counted
(`bad_entries`). Redis down: each replica goes on with its own placements' view, says so in
a log line, shows `extproc_shared_placements_degraded` 1, counts dropped items, and
reconnects by itself; placements made meanwhile by peers are missed (the queue drains in
seconds; the written count stays short by them), and the scorer floors its queue by the
in-flight prefill tokens again (which it leaves out while the fleet's placements arrive).
Redis Cluster: not shared (pub/sub is per node there), said once in a log line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from extproc.redis_broadcast import Broadcast, ChannelCounts, SharedOverBroadcast, by_order
from extproc.scheduling.plugins.ttft import PredictedTTFTScorer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SharedPlacementsStats(ChannelCounts):
    """Counters since start: the channel's (`bad_entries`: messages or items refused,
    undecodable, unknown scorer or server, values no placement has) and placements
    `applied` from the peers."""

    applied: int = 0


class SharedPlacements(SharedOverBroadcast[SharedPlacementsStats]):
    """Publishes this replica's `predicted-ttft-scorer` placements; folds the peers'. `scorers`
    maps names to the scheduler's scorers (a peer's placement goes to the scorer of the same
    name: replicas run the same config)."""

    def __init__(
        self,
        client: Redis,
        scorers: Mapping[str, PredictedTTFTScorer],
        *,
        process_id: str,
        known: Callable[[str], bool] = lambda address: True,
        channel: str = "extproc:placements",
        interval_s: float = 0.05,
    ) -> None:
        self._scorers = dict(scorers)
        self._known = known
        broadcast = Broadcast(
            client,
            channel,
            self._apply,
            process_id=process_id,
            name="shared placements",
            logger=log,
            failed_msg="shared placements: Redis failing (%r); predicted TTFT's prefill queues "
            "and written tokens count this replica's placements only until Redis answers",
            healed_msg="shared placements: Redis answers again after %d failed exchanges",
            interval_s=interval_s,
            timed=True,
        )
        super().__init__(SharedPlacementsStats(), broadcast)
        for name, scorer in self._scorers.items():
            scorer.on_placed = lambda addr, work, prompt, secs, name=name: broadcast.send(
                (name, addr, work, prompt, secs)
            )
            # While Redis answers, the scorer's queue is the fleet's: it drops its in-flight
            # floor; while Redis fails, it takes it again (its queue sees its own share).
            scorer.fleet_folded = lambda: not broadcast.is_degraded

    @staticmethod
    def scorers(plugins: Iterable[object]) -> dict[str, PredictedTTFTScorer]:
        """The `predicted-ttft-scorer`s of a scheduler's plugins, named by their order among
        them (`by_order`; a peer's placement for a name this replica lacks is refused)."""
        return by_order(plugins, PredictedTTFTScorer)

    def _apply(self, timed: Any) -> None:
        # Shapes are checked here; a wrong one raises ValueError/TypeError, which the channel
        # counts as malformed and skips.
        age, (name, address, work, prompt, seconds) = timed
        scorer = self._scorers.get(str(name))
        if scorer is None:
            self._refused("no such scorer")
        elif not isinstance(address, str) or not self._known(address):
            self._refused("not a server of the pool")
        elif not scorer.fold(address, work, prompt, seconds, age):
            self._refused("figures out of bounds")
        else:
            self._counts.applied += 1
