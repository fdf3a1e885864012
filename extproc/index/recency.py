"""Write recency of one endpoint's block keys: which keys it holds, and which were written
least recently (the ones a bounded KV cache has evicted first).

The memory index used to keep this as an OrderedDict, moving every key of every write to
the end: four hashed operations and a linked-list node per block, the largest cost of a
long new prompt. Here a write costs one C-level `dict.update` of its keys (key -> write
number) and one append of the whole chain to a log. Eviction reads the log from its oldest
write and skips keys a later write has touched again (their write number moved on), so the
order is exactly the OrderedDict's: by last write, and within one write tail first (so a
prefix loses its tail before its head).

Stale log entries (keys written again later, or discarded) are dropped by eviction as it
passes them; without eviction they are filtered out in the background of later writes once
they outnumber the live keys: a bounded slice per write (a few times the write's own size),
oldest first, so memory stays proportional to the keys held and no write ever pays for a
rebuild of the whole log.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from itertools import compress, repeat

# Start filtering the log once it holds this many times the live keys (plus a floor).
_COMPACT_RATIO = 2
_COMPACT_FLOOR = 4096
# While filtering, each write filters this many times its own size of old log (plus a floor).
_STEP_RATIO = 4
_STEP_FLOOR = 256

# A log entry: [write number, keys of that write, how many of them from the tail are gone].
Entry = list


class WriteOrder:
    """Block keys of one endpoint in least-recently-written order."""

    __slots__ = ("_done", "_latest", "_log", "_logged", "_next")

    def __init__(self) -> None:
        self._latest: dict[int, int] = {}  # key -> number of the last write that touched it
        # The log is `_done` then `_log`: `_done` holds old entries already filtered by an
        # ongoing compaction (empty when none runs); new writes append to `_log`.
        self._done: deque[Entry] = deque()
        self._log: deque[Entry] = deque()
        self._logged = 0  # keys in the log, stale ones included
        self._next = 0

    def __len__(self) -> int:
        return len(self._latest)

    def __iter__(self) -> Iterator[int]:
        return iter(self._latest)

    def __contains__(self, key: object) -> bool:
        return key in self._latest

    def touch(self, keys: Sequence[int]) -> None:
        """`keys` were just written (block 0 first): they become the most recent, the head
        of the chain last of all."""
        if not keys:
            return
        n = self._next = self._next + 1
        self._latest.update(zip(keys, repeat(n)))
        self._log.append([n, keys, 0])
        self._logged += len(keys)
        if self._done or self._logged > _COMPACT_RATIO * len(self._latest) + _COMPACT_FLOOR:
            self._filter(_STEP_RATIO * len(keys) + _STEP_FLOOR)

    def discard(self, keys: Sequence[int]) -> None:
        """Forget `keys` (their log entries become stale)."""
        latest = self._latest
        deque(map(latest.pop, keys, repeat(None)), maxlen=0)

    def pop_oldest(self, count: int) -> list[int]:
        """Remove and return the `count` least recently written keys (fewer if fewer held)."""
        out: list[int] = []
        latest = self._latest
        while len(out) < count:
            log = self._done or self._log
            if not log:
                break
            entry = log[0]
            n, keys, used = entry
            end = len(keys) - used
            # Tail first. A write whose live keys all go is taken whole at C speed; only
            # the last, partly evicted write is walked key by key.
            tail = keys[end - 1 :: -1]
            live = list(compress(tail, map(n.__eq__, map(latest.get, tail, repeat(0)))))
            if len(live) <= count - len(out):
                deque(map(latest.pop, live), maxlen=0)
                out += live
                self._logged -= end
                log.popleft()
                continue
            i = end
            while i > 0 and len(out) < count:
                i -= 1
                key = keys[i]
                if latest.get(key) == n:
                    del latest[key]
                    out.append(key)
            self._logged -= end - i
            entry[2] = len(keys) - i
        return out

    def _filter(self, budget: int) -> None:
        """Move up to `budget` keys' worth of the oldest unfiltered entries to `_done`,
        keeping only their live keys; when none are left, `_done` is the whole log."""
        latest, log, done = self._latest, self._log, self._done
        while budget > 0 and log:
            n, keys, used = log.popleft()
            end = len(keys) - used
            head = keys[:end]
            live = list(compress(head, map(n.__eq__, map(latest.get, head, repeat(0)))))
            if live:
                done.append([n, live, 0])
            self._logged -= end - len(live)
            budget -= end
        if not log:
            self._log, self._done = done, log
