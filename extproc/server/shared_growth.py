"""Session growth learned by one picker replica, shared with the others.

`bounded-sessions-filter` with `keepTogetherGrowth` leaves a new session to the scorers when
sessions on its prefix were seen to grow little past it, and bounds it while none was seen
continued (session_growth.py). Each replica learns that from the later turns it places; behind one
gateway with three replicas each sees a third of them, and 45-69 of ~120 new sessions a bench
run (tenants at the knee) were bounded for want of growth, against 0-18 with one replica
(bench/RESULTS.md, eighteenth session). With `shareGrowth: true` on the filter, each record
that rises on one replica (`LiveSessions.on_grown`: how many blocks a session grew past its
first turn, and the prefix keys it is now the most seen under) is published on a batched
Redis pub/sub channel (redis_broadcast.py) and merged by every peer as the larger of the two,
as if it had seen that session itself. With `learnUncontinued`, a first turn that no later
turn continued within the horizon is such a record too (growth 0, published by the replica
that placed it), so every replica keeps a one-shot group's repeats with its holder once one
replica has seen the group's first request go uncontinued; the records keep the most seen, so
a session of the group that does come back, on any replica, outranks it everywhere.

A replica that starts late (a rolling restart, a scale-up, a crash restart) or whose
subscription was cut learns what its peers learned before: each published record is also
kept in a bounded snapshot in Redis (retained.py: a hash `{extproc:growth}:retained`, one
entry per filter and key list, a later rise of the same session replacing it; the oldest
trimmed past `_RETAINED` entries, expiring an hour after the fleet's last publish), which
every replica reads after each subscribe, on start and after each reconnect, through the same
checks as pushed records (`extproc_shared_growth_snapshot_{reads,entries}_total`). A
replica that reads it empty (a Redis restarted without persistence, an hour without any
record rising) publishes its whole record again, one item per figure (`reseeded`), so the
snapshot holds what the fleet knows again for whoever starts next.

Bounded: a record carries at most `_MAX_KEYS` keys (a longer first turn's records go out in
several items), each merged record stays within the filter's `maxSessions` keys (the least
recently grown forgotten first), the snapshot holds at most `_RETAINED` entries of at most
4 KiB (an item of `_MAX_KEYS` keys is ~2.4 KiB), and the channel's backlog is bounded.
A peer's item is checked before it touches the record: a known filter, a whole
growth within `_MAX_GROWTH` blocks, at most `_MAX_KEYS` keys each a 64-bit block key; anything
else is refused and counted (`bad_entries`, a rate-limited warning), never raised. A forged
record can only make new sessions on a prefix look bigger (bounded, the filter's behaviour
without the option) or be outgrown by the real ones (records keep the most seen).

Redis down: each replica goes on learning from its own placements, says so in one log line,
shows `extproc_shared_growth_degraded` 1 and counts the dropped records; it reconnects by
itself and reads the snapshot again (records its peers published meanwhile are there).
Records whose batch failed while Redis was unreachable are counted as dropped and reach the
peers only when they rise again, unless Redis came back empty (restarted without
persistence): then every replica reading the empty snapshot sends its whole record. A failed
snapshot read or write is said in a rate-limited warning and shows degraded too. Redis
Cluster: not shared (pub/sub is per node there), said once in a log line.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from redis.asyncio import Redis

from extproc.redis_broadcast import Broadcast, ChannelCounts, SharedOverBroadcast, by_order
from extproc.retained import Retention
from extproc.scheduling.plugins.sessions import BoundedSessionsFilter, Grown, LiveSessions

log = logging.getLogger(__name__)

# Keys per published record: a first turn of 2,048 blocks has 263 records (one per 8 blocks
# and its first 7), so one item almost always; 256 x 9 bytes of msgpack keeps an item small.
_MAX_KEYS = 256
# The most blocks a session may be said to have grown (2**20 blocks of 16 tokens: 16M tokens,
# past any context window).
_MAX_GROWTH = 1 << 20
# Snapshot entries (one per record item): at ~20 keys an item for a first turn of ~100
# blocks, 8,192 entries hold ~160k keys, past the 50k `maxSessions` a filter keeps by default;
# at most 8,192 x 4 KiB = 32 MiB in Redis, ~1.5 MiB typical.
_RETAINED = 8192


@dataclass(slots=True)
class SharedGrowthStats(ChannelCounts):
    """Counters since start: the channel's (`bad_entries`: messages or records refused,
    undecodable, unknown filter, figures no session has), peers' records `applied` (pushed
    or from the snapshot), successful `snapshot_reads` (on start and after each reconnect)
    and the `snapshot_entries` they handed to the checks, records too large to keep in the
    snapshot (`unretained`), records sent again into a snapshot read empty (`reseeded`)."""

    applied: int = 0
    snapshot_reads: int = 0
    snapshot_entries: int = 0
    unretained: int = 0
    reseeded: int = 0


class SharedGrowth(SharedOverBroadcast[SharedGrowthStats]):
    """Publishes the growth records of `sessions` (filter name -> its live-session record)
    that rise here; merges the peers'. A peer's record goes to the filter of the same name
    (replicas run the same config)."""

    def __init__(
        self,
        client: Redis,
        sessions: Mapping[str, LiveSessions],
        *,
        process_id: str,
        channel: str = "extproc:growth",
        interval_s: float = 0.05,
        retained: int = _RETAINED,
    ) -> None:
        self._sessions = dict(sessions)
        broadcast = Broadcast(
            client,
            channel,
            self._apply,
            process_id=process_id,
            name="shared growth",
            logger=log,
            failed_msg="shared growth: Redis failing (%r); bounded-sessions-filter learns "
            "session growth from this replica's placements only until Redis answers",
            healed_msg="shared growth: Redis answers again after %d failed exchanges",
            interval_s=interval_s,
            retention=Retention(_identity, max_entries=retained),
            reseed=self._reseed,
        )
        super().__init__(SharedGrowthStats(), broadcast)
        for name, record in self._sessions.items():
            record.on_grown = lambda grown, name=name: self._send(name, grown)

    @property
    def stats(self) -> SharedGrowthStats:
        c = self._channel.stats
        return dataclasses.replace(
            super().stats,
            snapshot_reads=c.snapshot_reads,
            snapshot_entries=c.snapshot_entries,
            unretained=c.unretained,
            reseeded=c.reseeded,
        )

    @staticmethod
    def records(plugins: Iterable[object]) -> dict[str, LiveSessions]:
        """The records of a scheduler's `bounded-sessions-filter`s that share growth, named by
        the filters' order among the plugins (as shared sessions name them)."""
        found = by_order(plugins, BoundedSessionsFilter)
        return {name: p.sessions for name, p in found.items() if p.sessions.shares_growth}

    def _send(self, name: str, grown: Grown) -> None:
        grew, keys = grown
        for i in range(0, len(keys), _MAX_KEYS):
            self._channel.send((name, grew, keys[i : i + _MAX_KEYS]))

    def _reseed(self) -> list[tuple[str, int, tuple[int, ...]]]:
        return [
            (name, grew, keys[i : i + _MAX_KEYS])
            for name, record in self._sessions.items()
            for grew, keys in record.growth_records()
            for i in range(0, len(keys), _MAX_KEYS)
        ]

    def _apply(self, item: Any) -> None:
        # A wrong shape raises ValueError/TypeError: the channel counts it malformed, skips it.
        name, grew, keys = item
        record = self._sessions.get(name) if isinstance(name, str) else None
        if record is None:
            self._refused("no such filter")
        elif type(grew) is not int or not 0 <= grew <= _MAX_GROWTH:
            self._refused("growth out of bounds")
        elif (
            not isinstance(keys, list)
            or not 0 < len(keys) <= _MAX_KEYS
            or not all(type(k) is int and 0 <= k < 1 << 64 for k in keys)
        ):
            self._refused("not block keys")
        else:
            record.merge_growth((grew, tuple(keys)))
            self._counts.applied += 1


def _identity(item: Any) -> bytes:
    """What a growth item replaces in the snapshot: the record of the same filter under the
    same keys (the same session risen again keeps its newest, larger figure; sessions
    sharing a header keep their own entries)."""
    name, _grew, keys = item
    return msgspec.msgpack.encode([name, keys])
