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
(redis_broadcast.py), empty when it heard nothing (so the peers know it shares). The
subscriber's per-message cost stays a counter bump; no Redis call is made on the message or
placement path. The fleet's placements come from the shared in-flight exchange, which already
dates every peer's placements (`SharedInFlight.on_peer_placed`), counted only from the peers
whose heard counts arrive (sent within `PEER_TIMEOUT_CHECKS` checks): a peer of an older
version during a rolling upgrade, or one whose channel fails while its exchange works, places
requests whose answers it would never tell, and counting them would flag its publishers here
(those placements are counted in `unshared`). And while a live peer's counts do not arrive,
the publishers feeding it are heard by nobody here: every replica then judges alone, as
below, said in a line naming the peer. Peers' items are checked before use (endpoints
of the pool only, whole positive counts under a bound), so a forged message can end a silence
early, no more. Redis down (the channel or the in-flight exchange failing): each replica
judges from its own placements and the publishers it hears, as without sharing, said in the
channel's log line and `extproc_kv_events_silence_fleet_degraded` 1; the fleet's tallies
restart once Redis answers. Redis Cluster: not shared (pub/sub is per node there), said in a
log line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from extproc.index.silence import SilenceWatch
from extproc.redis_broadcast import Broadcast, ChannelCounts, SharedOverBroadcast
from extproc.throttle import Throttle

log = logging.getLogger(__name__)

# A peer's placements count while its last heard counts came within this many checks (it
# sends every check; one lost or late batch is no reason to drop it).
PEER_TIMEOUT_CHECKS = 3.0
# More messages from one endpoint in one replica's batch than any publisher sends in a check
# interval (vLLM sends a batch per engine step, at most a few hundred a second).
_MAX_MESSAGES = 1_000_000


@dataclass(slots=True)
class SharedSilenceStats(ChannelCounts):
    """Counters since start: the channel's (items are one replica's heard counts per check;
    `bad_entries`: items or endpoints refused), the peers' KV-event messages `applied`, and
    `unshared`: peers' placements left out of the fleet's count because that peer's heard
    counts do not arrive (an older version, or its channel failing)."""

    applied: int = 0
    unshared: int = 0


class SharedSilence(SharedOverBroadcast[SharedSilenceStats]):
    """Shares `watch`'s heard counts with the peers and applies theirs; sets `watch` judging
    by the fleet while this channel and the in-flight exchange (`peers_ok`) answer and every
    live peer of the exchange (`peers`) shares its heard counts. `known`: whether an address
    is an endpoint of the pool. `is_degraded`: not judging by the fleet."""

    def __init__(
        self,
        client: Redis,
        watch: SilenceWatch,
        *,
        process_id: str,
        peers_ok: Callable[[], bool],
        peers: Callable[[], Collection[str]],
        known: Callable[[str], bool] = lambda address: True,
        channel: str = "extproc:kv-heard",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._watch = watch
        self._peers_ok = peers_ok
        self._peers = peers
        self._known = known
        self._throttle = Throttle(every_s=60.0)
        self._clock = clock
        # Per peer (its process id, as in the in-flight exchange): when its last heard counts
        # came (this clock).
        self._sharing: dict[str, float] = {}
        # Per live peer of the exchange not sharing (yet): when it was first seen so.
        self._seen: dict[str, float] = {}
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
            with_sender=True,
        )
        super().__init__(SharedSilenceStats(), broadcast)
        # A peer's message is told here up to one check interval (its batch) plus the
        # channel's interval after it was heard.
        watch.use_fleet(self._fleet_ok, lag_s=watch.every_s)

    def _fleet_ok(self) -> bool:
        """Whether the fleet's news arrives whole (asked once per check)."""
        if self._channel.is_degraded or not self._peers_ok():
            return False  # the channel's `Outage` says so
        now, ok = self._clock(), True
        peers = self._peers()
        for peer in peers:
            if self._shares(peer):
                self._seen.pop(peer, None)
                continue
            ok = False
            # A peer just seen in the exchange may not have sent its first counts yet.
            if now - self._seen.setdefault(peer, now) > PEER_TIMEOUT_CHECKS * self._watch.every_s:
                self._throttle.warn(
                    log,
                    "peer not sharing",
                    "shared KV-event silence: peer %s sends no heard counts (an older "
                    "version, or its channel failing); silence is judged per replica meanwhile",
                    peer[:64],
                )
        for gone in [p for p in self._seen if p not in peers]:
            del self._seen[gone]
        return ok

    @property
    def is_degraded(self) -> bool:
        """Silence is judged per replica: the fleet's news fails or is not whole."""
        return not self._fleet_ok()

    def _shares(self, peer: str) -> bool:
        at = self._sharing.get(peer)
        return at is not None and self._clock() - at <= PEER_TIMEOUT_CHECKS * self._watch.every_s

    def share(self) -> None:
        """Queue what this replica heard since the last call (one item, empty if nothing:
        the peers count this replica's placements while its items come)."""
        self._channel.send(self._watch.take_heard())
        old = self._clock() - PEER_TIMEOUT_CHECKS * self._watch.every_s
        for peer in [p for p, at in self._sharing.items() if at < old]:
            del self._sharing[peer]

    def peer_placed(self, peer: str, address: str, n: int) -> None:
        """`peer` placed `n` requests on `address` (the in-flight exchange's callback)."""
        if not self._known(address):
            return
        if not self._shares(peer):
            self._counts.unshared += n
            return
        self._watch.peers_placed(address, n)

    async def run(self) -> None:
        await asyncio.gather(self._channel.run(), self._share_loop())

    async def _share_loop(self) -> None:
        while True:
            await asyncio.sleep(self._watch.every_s)
            self.share()

    def _apply(self, sent: Any) -> None:
        sender, item = sent
        if not isinstance(item, dict):
            raise TypeError("heard counts")
        self._sharing[sender] = self._clock()
        for address, n in item.items():
            if not isinstance(address, str) or not self._known(address):
                self._refused("not an endpoint of the pool")
            elif type(n) is not int or not 0 < n <= _MAX_MESSAGES:
                self._refused("count out of bounds")
            else:
                self._watch.peers_heard(address, n)
                self._counts.applied += n
