"""Request ends shared between picker replicas through Redis pub/sub.

Behind one gateway, a request's ext_proc stream and its access-log entry can reach different
replicas (Envoy balances each stream on its own). A replica that gets an entry for a request
it does not hold publishes it (batched, every `interval_s`) on one channel; every replica
applies what the others publish, so the replica holding the placement releases it within one
interval instead of at `max_hold_s`. Redis down: entries are dropped (counted), the holds
expire by themselves, the feature says it is degraded (one warning, `is_degraded`, a gauge
on /metrics) and the loops back off and reconnect by themselves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from extproc.endpoints.request_end import Ended, RequestEnds
from extproc.redis_broadcast import Broadcast, ChannelCounts, SharedOverBroadcast

log = logging.getLogger("extproc.request_end")


@dataclass(slots=True)
class SharedEndStats(ChannelCounts):
    """Counters since start: the channel's (items are unmatched access-log entries) and
    holds released by an entry another replica received (`applied`)."""

    applied: int = 0


class SharedRequestEnds(SharedOverBroadcast[SharedEndStats]):
    """Forwards this replica's unmatched access-log entries and applies the others'."""

    def __init__(
        self,
        client: Redis,
        ends: RequestEnds,
        *,
        process_id: str,
        channel: str = "extproc:request-ends",
        interval_s: float = 0.05,
    ) -> None:
        self._ends = ends
        broadcast = Broadcast(
            client,
            channel,
            self._apply,
            process_id=process_id,
            name="request ends",
            logger=log,
            failed_msg="request ends: Redis failing (%r); entries for other replicas' "
            "requests are dropped and their holds expire at max_hold_s until it is back",
            healed_msg="request ends: Redis back after %d failed exchanges",
            interval_s=interval_s,
        )
        super().__init__(SharedEndStats(), broadcast)
        ends.on_unmatched = self.forward

    def forward(self, entry: Ended) -> None:
        self._channel.send((entry.request_id, entry.ttfb_s, entry.upstream))

    def _apply(self, item: Any) -> None:
        rid, ttfb, upstream = item
        if self._ends.ended(Ended(str(rid), ttfb, str(upstream)), forwarded=True):
            self._counts.applied += 1
