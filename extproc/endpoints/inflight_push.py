"""Each placement pushed to the other replicas at decision time, so their in-flight counts
(and predicted TTFT's queue of the peers' tokens) hold it within a Redis round trip.

The shared in-flight exchange (shared_inflight.py) runs every `interval_s` each way: a peer's
placement reached a replica 0-2 intervals after it was made. At the tenants knee that window
was the cause left between three replicas and one: 30-56 of 242 decisions went to a server a
peer had just loaded, its queue under-predicted by a median 0.06-0.25 s (bench/RESULTS.md,
issue 14, fifteenth session). Here `SharedInFlight.acquire` hands each placement's server and
this replica's cumulative counters there to a Redis pub/sub channel published as soon as the
event loop gets to it (redis_broadcast.py with `interval_s=0`: one PUBLISH per batch, what
queues while one is under way goes in the next); the peers apply them with
`SharedInFlight.pushed`, which counts only growth past what they have seen of the sender, so
the exchange and the push never count a placement twice.

The hot path only appends to a list. Peers' items are checked here for shape (a server of the
pool, integer counters, a finite age) and there for growth (a known peer, bounded growth,
confirmed by the exchange within its TTL), so forged messages can skew a count for at most
the TTL and grow no state. Redis down: the exchange's own outage handling holds, pushes are
dropped (counted), the channel says so once in a log line and shows
`extproc_inflight_push_degraded` 1 until it answers; the peers' placements then come with
the exchange alone, as without pushing. Not on Redis Cluster (pub/sub is per node there).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from extproc.endpoints.shared_inflight import SharedInFlight
from extproc.redis_broadcast import Broadcast, ChannelCounts, SharedOverBroadcast

log = logging.getLogger(__name__)


@dataclass(slots=True)
class InFlightPushStats(ChannelCounts):
    """Counters since start: the channel's (items are placements; `bad_entries`: peers'
    items refused for their shape, undecodable, a server not in the pool, counters not
    integers) and peers' pushes `received` and handed to the in-flight counts (which
    count what they add: `SharedInFlightStats`)."""

    received: int = 0


class InFlightPush(SharedOverBroadcast[InFlightPushStats]):
    """Publishes this replica's placements as they are made; hands the peers' to `inflight`.
    `known`: whether an address is a server of the pool."""

    def __init__(
        self,
        client: Redis,
        inflight: SharedInFlight,
        *,
        known: Callable[[str], bool] = lambda address: True,
        channel: str | None = None,
    ) -> None:
        self._inflight = inflight
        self._known = known
        broadcast = Broadcast(
            client,
            channel or f"{inflight.namespace}:push",
            self._apply,
            process_id=inflight.process_id,
            name="in-flight push",
            logger=log,
            failed_msg="in-flight push: Redis failing (%r); the peers' placements are counted "
            "from the shared in-flight exchange alone (0-2 intervals late) until it answers",
            healed_msg="in-flight push: Redis answers again after %d failed calls",
            interval_s=0,
            timed=True,
            with_sender=True,
        )
        super().__init__(InFlightPushStats(), broadcast)
        inflight.on_placed = self._send

    async def aclose(self) -> None:
        self._inflight.on_placed = None
        await super().aclose()

    def _send(self, address: str, requests: int, tokens: int) -> None:
        self._channel.send((address, requests, tokens))

    def _apply(self, item: Any) -> None:
        # A wrong shape raises ValueError/TypeError: the channel counts it and skips it.
        sender, (age, (address, requests, tokens)) = item
        if (
            isinstance(address, str)
            and type(requests) is int
            and type(tokens) is int
            and isinstance(age, (int, float))
            and not isinstance(age, bool)
            and math.isfinite(age)
            and self._known(address)
        ):
            self._counts.received += 1
            self._inflight.pushed(sender, address, requests, tokens, float(age))
        else:
            self._refused("wrong types, or not a server of the pool")
