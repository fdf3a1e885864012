"""Picker replicas divide the metrics scrapes among themselves through Redis pub/sub: each
server is scraped by one replica, which passes what it read to the others.

Behind one gateway every replica scraped every server every 50 ms, so three replicas put
three times the scrape load on each engine's metrics endpoint, whose answer (~54 KB of
Prometheus text on vLLM 0.32) is rendered by the engine's own process, and read three
times what one replica would. Traced on the tenants workload (issue 14, fifteenth session):
with three replicas the simulated engines' process took twice the CPU of a one-replica run
for the same requests, and their prefill ran 1.1-1.4x slower than scheduled.

Who scrapes what: the replicas alive in the shared in-flight exchange (`members`, this one
included) rank every server by a hash of (replica id, server) and the highest scrapes it
(rendezvous hashing: a replica joining or leaving moves only its own share). The owner
stores its scrape as before and queues it on the channel; the others store it as if they
had scraped it, dated by its age (`MetricsScraper.apply`). A server whose figures have not
come from a peer for `takeover_s` is scraped here again (the owner slow, failing or gone,
or the replicas' views of who is alive briefly apart), so scraping never waits on Redis:
with Redis failing every replica scrapes every server, as without sharing; the channel's
`Outage` says so in a log line, `extproc_shared_scrapes_degraded` is 1, and the servers
scraped here for want of a peer's figures are counted
(`extproc_shared_scrapes_takeovers_total`). A server's failures are seen by whoever scrapes
it: the owner publishes nothing for a failing scrape, so the others take it over within
`takeover_s` and see the failure themselves. One replica (no peers) scrapes everything and
publishes nothing: it decides exactly as before.

Peers' figures are checked before use (servers of the pool only, counts and fractions in
range, finite), so Redis content cannot skew a replica without bound. Redis Cluster: not
shared (pub/sub is per node there), said in a log line.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import msgspec
from redis.asyncio import Redis
from xxhash import xxh3_64_intdigest

from extproc.endpoints.exposition import Scraped
from extproc.endpoints.scrape import MetricsScraper
from extproc.redis_broadcast import Broadcast, ChannelCounts, SharedOverBroadcast

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SharedScrapesStats(ChannelCounts):
    """Counters since start: the channel's (items are scrapes; `bad_entries`: peers' items
    that did not decode or were out of range), scrapes `applied` from the peers, peers'
    scrapes not applied (`stale`: older than what was stored, or of a server not in the
    pool), and `takeovers`: servers another replica owns that this one scraped because no
    peer's figures came within `takeover_s`."""

    applied: int = 0
    stale: int = 0
    takeovers: int = 0


def owner(address: str, members: Collection[str]) -> str:
    """The member that scrapes `address`: highest hash of (member, address)."""
    return max(members, key=lambda m: xxh3_64_intdigest(f"{m}\0{address}".encode()))


def _plausible(s: Scraped) -> bool:
    """Figures a scrape could have produced (a peer's, read from Redis)."""
    if s.waiting < 0 or s.running < 0 or not 0.0 <= s.kv_usage <= 1.0:
        return False
    ints = (s.kv_block_size, s.kv_blocks, s.max_adapters, s.prefix_cache_queries,
            s.prefix_cache_hits, s.prompt_tokens, s.finished)  # fmt: skip
    if any(v is not None and v < 0 for v in ints):
        return False
    if s.process_start_s is not None and not math.isfinite(s.process_start_s):
        return False
    lat = s.latency
    if lat is not None:
        values = [getattr(lat, f.name) for f in dataclasses.fields(lat)]
        if any(v is not None and not (math.isfinite(v) and v >= 0) for v in values):
            return False
    return True


class SharedScrapes(SharedOverBroadcast[SharedScrapesStats]):
    """Divides `scraper`'s servers among the replicas in `members()` (ids, this one's
    `process_id` included or not) and applies the peers' scrapes to it. Set as the
    scraper's `share`."""

    def __init__(
        self,
        client: Redis,
        scraper: MetricsScraper,
        members: Callable[[], Collection[str]],
        *,
        process_id: str,
        takeover_s: float,
        channel: str = "extproc:scrapes",
        interval_s: float = 0.02,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._scraper = scraper
        self._members = members
        self._id = process_id
        self._takeover_s = takeover_s
        self._clock = clock
        # Per server: when the last peer's scrape of it was applied (this clock).
        self._heard: dict[str, float] = {}
        # A replica just started has heard nobody yet: its peers get one takeover_s to be
        # heard before their servers count as taken over (else every start counted some).
        self._started = clock()
        # Servers this replica scrapes though a peer owns them (no figures came in time).
        self._taken_over: set[str] = set()
        broadcast = Broadcast(
            client,
            channel,
            self._apply,
            process_id=process_id,
            name="shared scrapes",
            logger=log,
            failed_msg="shared scrapes: Redis failing (%r); this replica scrapes every "
            "server itself until it answers",
            healed_msg="shared scrapes: Redis answers again after %d failed exchanges",
            interval_s=interval_s,
            timed=True,
        )
        super().__init__(SharedScrapesStats(), broadcast)
        scraper.share = self

    def _owns(self, address: str, members: Collection[str]) -> bool:
        """Whether this replica scrapes `address` among `members` (asked once per scrape:
        each `members()` copies the set of live peers)."""
        return not members or owner(address, {self._id, *members}) == self._id

    # -- the scraper's seam (ScrapeShare) --------------------------------------------------

    def wants(self, address: str) -> bool:
        if self._owns(address, self._members()):
            self._taken_over.discard(address)
            return True
        heard = self._heard.get(address, self._started)
        if self._clock() - heard <= self._takeover_s:
            self._taken_over.discard(address)
            return False
        if address not in self._taken_over:
            # Counted once per spell: a peer's figures stopped coming (or never came).
            self._taken_over.add(address)
            self._counts.takeovers += 1
        return True

    def scraped(self, address: str, scraped: Scraped) -> None:
        # Only the owner's scrapes go out (a takeover's would make the others take its
        # figures for the owner's, and stop scraping a server nobody scrapes well).
        members = self._members()
        if members and self._owns(address, members):
            self._channel.send((address, scraped))

    # -- the channel -----------------------------------------------------------------------

    def _apply(self, timed: Any) -> None:
        age_s, (address, raw) = timed
        address, age_s = str(address), float(age_s)
        try:
            scraped = msgspec.convert(raw, Scraped)
        except msgspec.ValidationError as exc:
            raise ValueError(str(exc)) from None
        if not (math.isfinite(age_s) and 0.0 <= age_s <= 60.0) or not _plausible(scraped):
            self._refused("implausible figures or age")
            return
        if not self._scraper.apply(address, scraped, age_s):
            self._counts.stale += 1
            return
        self._heard[address] = self._clock() - age_s
        self._counts.applied += 1
