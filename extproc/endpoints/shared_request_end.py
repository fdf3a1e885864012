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
from extproc.redis_broadcast import Broadcast

log = logging.getLogger("extproc.request_end")


@dataclass(slots=True)
class SharedEndStats:
    """Counters since start: entries published to the other replicas, holds released by an
    entry another replica received, entries dropped (Redis failing or backlog full)."""

    published: int = 0
    applied: int = 0
    dropped: int = 0


class SharedRequestEnds:
    """Forwards this replica's unmatched access-log entries and applies the others'."""

    def __init__(
        self,
        ends: RequestEnds,
        client: Redis,
        *,
        process_id: str,
        channel: str = "extproc:request-ends",
        interval_s: float = 0.05,
    ) -> None:
        self._ends = ends
        self._applied = 0
        self._channel = Broadcast(
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
        ends.on_unmatched = self.forward

    @classmethod
    def from_url(cls, url: str, ends: RequestEnds, *, process_id: str) -> SharedRequestEnds:
        client = Broadcast.client(url)
        return cls(ends, client, process_id=process_id)

    @property
    def stats(self) -> SharedEndStats:
        sent = self._channel.stats
        return SharedEndStats(published=sent.published, applied=self._applied, dropped=sent.dropped)

    @property
    def is_degraded(self) -> bool:
        """True while the last publish or read failed: ends are not shared."""
        return self._channel.is_degraded

    def forward(self, entry: Ended) -> None:
        self._channel.send((entry.request_id, entry.ttfb_s, entry.upstream))

    async def run(self) -> None:
        await self._channel.run()

    def _apply(self, item: Any) -> None:
        rid, ttfb, upstream = item
        if self._ends.ended(Ended(str(rid), ttfb, str(upstream)), forwarded=True):
            self._applied += 1

    async def aclose(self) -> None:
        await self._channel.aclose()
