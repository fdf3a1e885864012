"""A bounded snapshot of a pub/sub channel's long-lived records, kept in Redis so that a
replica that subscribes late (a rolling restart, a scale-up, a crash restart, a connection
lost meanwhile) learns what its peers published before it listened.

Pub/sub (redis_broadcast.py) reaches only the replicas subscribed when a record is
published. For a channel whose records stay true for long (learned session growth), the
publisher also keeps each record in a Redis hash, one field per record identity (the feature
says what identifies a record: a later record of the same identity replaces it), with the
record's time of publication in a sorted set beside it. Whoever publishes refreshes both
keys' expiry (`ttl_s`: a fleet that stops publishing leaves nothing behind for long) and
trims the oldest past `max_entries`; a record whose encoding exceeds `max_entry_bytes` is
not kept (counted). Redis memory is so bounded by about `max_entries x max_entry_bytes` per
channel, whatever the load. Both keys carry the channel's name as a hash tag
(`{<channel>}:retained`, `{<channel>}:retained:order`), so on Redis Cluster they share one
hash slot and one script reaches both.

A subscriber reads the snapshot after each successful subscribe (on start, and after every
reconnect: what was published while it was away is there), by HSCAN and never more than
`max_entries` entries or any entry past `max_entry_bytes`, so a stray writer filling the hash
cannot make the read unbounded. Each entry is `[sender, item]` in msgpack, applied through
the channel's own checks exactly as a pushed item: an entry that does not decode or that the
feature refuses is counted as malformed or refused, never raised. Subscribing before reading
means a record published in between arrives twice at worst; the features that retain merge
idempotently (growth keeps the larger figure).

Transient channels (placements, scrapes, observations, request ends, the in-flight push)
carry no snapshot: a late joiner must not act on stale figures, and fresh ones arrive within
an interval. See docs/operations.md (`extproc_shared_growth_*`).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from redis.asyncio import Redis
from redis.exceptions import NoScriptError

# One script, so that the records, their order and the trim land together (and atomically):
# trimmed by a second call, a publisher that died (or lost Redis) between the two left the
# snapshot over its bound until the next publish. The caller's clock orders the records
# (only the trim's choice of "oldest" depends on it).
# KEYS: hash, order; ARGV: ttl ms, max entries, now, then field, entry pairs.
_WRITE = """
local ttl, most, now = ARGV[1], tonumber(ARGV[2]), ARGV[3]
for i = 4, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  redis.call('ZADD', KEYS[2], now, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('PEXPIRE', KEYS[2], ttl)
local over = redis.call('ZCARD', KEYS[2]) - most
if over > 0 then
  local popped = redis.call('ZPOPMIN', KEYS[2], over)
  for i = 1, #popped, 2 do
    redis.call('HDEL', KEYS[1], popped[i])
  end
end
return 0
"""
_WRITE_SHA = hashlib.sha1(_WRITE.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Retention:
    """How a channel keeps its snapshot: `identity(item)` names the record an item
    replaces (bytes; hashed, so its length does not matter), at most `max_entries` records
    of at most `max_entry_bytes` each, kept `ttl_s` past the last publish."""

    identity: Callable[[Any], bytes]
    max_entries: int = 2048
    max_entry_bytes: int = 4096
    ttl_s: float = 3600.0


class Retained:
    """The snapshot of one channel: `write` keeps a published batch's records (bounded),
    `read` returns the entries (bounded)."""

    def __init__(self, channel: str, retention: Retention) -> None:
        self.key = f"{{{channel}}}:retained"
        self.order_key = f"{{{channel}}}:retained:order"
        self._r = retention

    async def write(self, client: Redis, sender: str, items: list[Any]) -> int:
        """Keeps the records of `items` (published by `sender`), refreshes the expiry and
        trims the oldest past the bound, in one script; returns how many items were too
        large to keep. The caller bounds the call in time."""
        fields: dict[bytes, bytes] = {}
        too_big = 0
        for item in items:
            entry = msgspec.msgpack.encode([sender, item])
            if len(entry) > self._r.max_entry_bytes:
                too_big += 1
                continue
            fields[hashlib.blake2b(self._r.identity(item), digest_size=16).digest()] = entry
        if not fields:
            return too_big
        args: list[Any] = [int(self._r.ttl_s * 1000), self._r.max_entries, time.time()]
        for name, entry in fields.items():
            args += (name, entry)
        keys = (self.key, self.order_key)
        try:
            await client.evalsha(_WRITE_SHA, 2, *keys, *args)
        except NoScriptError:
            await client.eval(_WRITE, 2, *keys, *args)
        return too_big

    async def read(self, client: Redis) -> tuple[list[bytes], int]:
        """The snapshot's entries (at most `max_entries`, each at most `max_entry_bytes`)
        and how many were skipped as too large. A few Redis calls (one per 256 entries):
        the caller bounds the whole in time."""
        entries: list[bytes] = []
        too_big = 0
        cursor = 0
        while True:
            cursor, page = await client.hscan(self.key, cursor, count=256)
            values: Any = page.values() if isinstance(page, dict) else ()
            for value in values:
                if not isinstance(value, bytes) or len(value) > self._r.max_entry_bytes:
                    too_big += 1
                elif len(entries) < self._r.max_entries:
                    entries.append(value)
            if not cursor or len(entries) >= self._r.max_entries:
                return entries, too_big
