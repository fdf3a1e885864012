"""What each picker replica learns from its own placements, shared with the other replicas
through Redis pub/sub: prefill-speed samples per server and the cold picks of
`no-hit-lru-scorer`.

Behind one gateway each of N replicas places about 1/N of the requests. Learned from that
share alone, the replicas disagree: one run of the agentic workload (bench/trace_replicas.py)
left the same server at 8,800 tok/s on one replica and 72,000 on another, so predicted TTFT
ranked servers differently on each; and each replica's LRU of new-prefix picks spread only
its own new prefixes, so the first picks of the replicas landed on the same servers. Each
replica therefore publishes what it observes and applies the others': every replica's
estimates are drawn from every placement.

On with `state.shared_observations: true`, or `auto` where the index is a non-Cluster Redis
index and the scheduler has something to share (server/assembly.py decides and says so at
start), the default (config.py says why; in the fifth session's interleaved runs it made the
replicas agree but TTFT p90 was not measurably better, which kept it opt-in until the
twenty-second's runs over every scorecard workload).
The hot path never touches Redis: a sample or a pick is applied locally at once and queued
on a batched pub/sub channel (redis_broadcast.py); a replica that is disconnected misses what
was said meanwhile, which costs it a few samples of a rolling window, no more. Redis down:
the replica learns from its own placements alone, says so in a log line, counts failures and
dropped items (`extproc_shared_observations_*`), shows `extproc_shared_observations_degraded`
1 and reconnects by itself. Redis Cluster: not shared
(pub/sub is per node there), said once in a log line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from extproc.endpoints.prefill_speed import PrefillSpeeds
from extproc.redis_broadcast import Broadcast, ChannelCounts, SharedOverBroadcast, by_order
from extproc.scheduling.plugins.prefix import NoHitLRUScorer

log = logging.getLogger(__name__)

# Item kinds on the channel: a prefill-speed sample (address, tokens/s) and a cold pick of
# a `no-hit-lru-scorer` (plugin name, address).
_SAMPLE, _PICK = "s", "p"


@dataclass(slots=True)
class SharedObservationsStats(ChannelCounts):
    """Counters since start: the channel's (items are samples and picks; `bad_entries`:
    undecodable messages and items), items `applied` from the peers, peers' items naming a server
    not in this replica's pool (`unknown_endpoint`, skipped), and peers' picks for a
    `no-hit-lru-scorer` this replica's scheduler lacks (`unknown_scorer`, skipped)."""

    applied: int = 0
    # Routine while replicas briefly disagree on the pool (one saw a pod come or go first),
    # so counted without a log line; a steady rate means replicas watch different pools.
    unknown_endpoint: int = 0
    # Never routine: the replicas run different scheduler configs (an operator mistake), so
    # counted and said in the channel's rate-limited warning.
    unknown_scorer: int = 0


class SharedObservations(SharedOverBroadcast[SharedObservationsStats]):
    """Publishes this replica's speed samples and cold picks; applies the peers'. `lru` maps
    plugin names to the `no-hit-lru-scorer`s of the scheduler (a peer's pick is applied to
    the plugin of the same name)."""

    def __init__(
        self,
        client: Redis,
        speeds: PrefillSpeeds,
        lru: Mapping[str, NoHitLRUScorer],
        *,
        process_id: str,
        known: Callable[[str], bool] = lambda address: True,
        channel: str = "extproc:observations",
        interval_s: float = 0.05,
    ) -> None:
        self._speeds = speeds
        self._lru = dict(lru)
        # Peers' items name servers of the pool only: a bad message must not grow the
        # per-server state here without bound.
        self._known = known
        broadcast = Broadcast(
            client,
            channel,
            self._apply,
            process_id=process_id,
            name="shared observations",
            logger=log,
            failed_msg="shared observations: Redis failing (%r); prefill speeds and new-prefix "
            "spreading learn from this replica's placements only until Redis answers",
            healed_msg="shared observations: Redis answers again after %d failed exchanges",
            interval_s=interval_s,
        )
        super().__init__(SharedObservationsStats(), broadcast)
        speeds.on_sample = lambda address, tps: broadcast.send((_SAMPLE, address, tps))
        for name, plugin in self._lru.items():
            plugin.on_pick = lambda addr, name=name: broadcast.send((_PICK, name, addr))

    @staticmethod
    def lru_scorers(plugins: Iterable[object]) -> dict[str, NoHitLRUScorer]:
        """The `no-hit-lru-scorer`s of a scheduler's plugins, named by their order among
        them (`by_order`; a peer's pick for a name this replica lacks is counted in
        `unknown_scorer` and said)."""
        return by_order(plugins, NoHitLRUScorer)

    def _apply(self, item: Any) -> None:
        # A wrong shape or kind raises ValueError/TypeError: the channel counts it as
        # malformed (`bad_entries`) and says so, rate-limited.
        kind, first, second = item
        if kind == _SAMPLE:
            if not self._known(str(first)):
                self._counts.unknown_endpoint += 1
                return
            self._speeds.add(str(first), float(second))
            self._counts.applied += 1
        elif kind == _PICK:
            lru = self._lru.get(str(first))
            if lru is None:
                self._counts.unknown_scorer += 1
                self._channel.warn(
                    "unknown scorer",
                    f"a peer's new-prefix pick is for no-hit-lru-scorer #{str(first)[:16]}, "
                    f"and this replica's scheduler has {len(self._lru)} of them (replicas "
                    "on different configs?); skipped",
                )
                return
            if not self._known(str(second)):
                self._counts.unknown_endpoint += 1
                return
            lru.picked(str(second))
            self._counts.applied += 1
        else:  # not silently: a peer on another version (or a stray publisher) sent it
            raise ValueError(f"unknown item kind {str(kind)[:16]!r}")
