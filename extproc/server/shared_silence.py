"""KV-event silence judged fleet-wide: picker replicas tell each other which endpoints' KV-event
publishers they heard, so each judges an endpoint's silence against every replica's messages
and placements (index/silence.py, `SilenceWatch.use_fleet`).

Replicas sharing a Redis index behind one bound `index.kv_events.bind` address each hear only
the publishers that connected to them. Judged alone, a replica cannot tell a publisher that
feeds a peer from a silent one: it either flags the first (a publisher that moved to another
replica after a restart or a load balancer's choice) or, as before this, leaves unjudged every
endpoint it never heard, so a publisher silent from its start went unflagged everywhere.

Here each replica sends, once per silence check (`every_s`), how many messages it heard per
endpoint since the last send: one item on a batched Redis pub/sub channel
(redis_broadcast.py), nothing when it heard nothing. The subscriber's per-message cost stays a
counter bump; no Redis call is made on the message or placement path. The fleet's placements
come from the shared in-flight exchange, which already dates every peer's placements
(`SharedInFlight.on_peer_placed`). Peers' items are checked before use (endpoints of the pool
only, whole positive counts under a bound), so a forged message can end a silence early, no
more. Redis down (the channel or the in-flight exchange failing): each replica judges from its
own placements and the publishers it hears, as without sharing, said in the channel's log line
and `extproc_kv_events_silence_fleet_degraded` 1; the fleet's tallies restart once Redis
answers. Redis Cluster: not shared (pub/sub is per node there), said in a log line.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from extproc.index.silence import SilenceWatch
from extproc.redis_broadcast import Broadcast, ChannelCounts, SharedOverBroadcast

log = logging.getLogger(__name__)

# More messages from one endpoint in one replica's batch than any publisher sends in a check
# interval (vLLM sends a batch per engine step, at most a few hundred a second).
_MAX_MESSAGES = 1_000_000


@dataclass(slots=True)
class SharedSilenceStats(ChannelCounts):
    """Counters since start: the channel's (items are one replica's heard counts per check;
    `bad_entries`: items or endpoints refused) and the peers' KV-event messages `applied`."""

    applied: int = 0


class SharedSilence(SharedOverBroadcast[SharedSilenceStats]):
    """Shares `watch`'s heard counts with the peers and applies theirs; sets `watch` judging
    by the fleet while this channel and the in-flight exchange (`peers_ok`) answer. `known`:
    whether an address is an endpoint of the pool."""

    def __init__(
        self,
        client: Redis,
        watch: SilenceWatch,
        *,
        process_id: str,
        peers_ok: Callable[[], bool],
        known: Callable[[str], bool] = lambda address: True,
        channel: str = "extproc:kv-heard",
    ) -> None:
        self._watch = watch
        self._known = known
        broadcast = Broadcast(
            client,
            channel,
            self._apply,
            process_id=process_id,
            name="shared KV-event silence",
            logger=log,
            failed_msg="shared KV-event silence: Redis failing (%r); each replica judges "
            "publishers' silence from its own placements and the publishers it hears until "
            "Redis answers",
            healed_msg="shared KV-event silence: Redis answers again after %d failed exchanges",
            # The heard counts are queued once per check; this is how soon they go out then.
            interval_s=0.05,
        )
        super().__init__(SharedSilenceStats(), broadcast)
        # A peer's message is told here up to one check interval (its batch) plus the
        # channel's interval after it was heard.
        watch.use_fleet(lambda: not broadcast.is_degraded and peers_ok(), lag_s=watch.every_s)

    def share(self) -> None:
        """Queue what this replica heard since the last call (one item; none if nothing)."""
        heard = self._watch.take_heard()
        if heard:
            self._channel.send(heard)

    async def run(self) -> None:
        await asyncio.gather(self._channel.run(), self._share_loop())

    async def _share_loop(self) -> None:
        while True:
            await asyncio.sleep(self._watch.every_s)
            self.share()

    def _apply(self, item: Any) -> None:
        if not isinstance(item, dict):
            raise TypeError("heard counts")
        for address, n in item.items():
            if not isinstance(address, str) or not self._known(address):
                self._refused("not an endpoint of the pool")
            elif type(n) is not int or not 0 < n <= _MAX_MESSAGES:
                self._refused("count out of bounds")
            else:
                self._watch.peers_heard(address, n)
                self._counts.applied += n
