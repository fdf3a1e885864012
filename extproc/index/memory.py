"""In-process KV-block index: the embedded default, and the reference the Redis backend is
tested against (same contract suite).

Writes apply at once (no queue: they cost a few dict operations); one process only, so it
cannot share affinity between replicas. Not thread-safe: use it from one event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Collection, Sequence
from itertools import groupby, repeat
from types import TracebackType

from extproc.index.base import (
    EMPTY,
    FULL_GROUP,
    GPU,
    GroupSpec,
    IndexOptions,
    IndexStats,
    Lookup,
    entry_tag,
    filter_matches,
)
from extproc.index.prefix import Segment, parse_tag, prefix_matches
from extproc.index.recency import WriteOrder

Records = tuple[tuple[str, int], ...]


class MemoryKVIndex:
    """A `KVIndex` held in this process (see `base.KVIndex` for the contract)."""

    def __init__(self, options: IndexOptions | None = None) -> None:
        self._opt = options if options is not None else IndexOptions()
        # Equal consecutive values are the same tuple object (see `_update`), so a lookup
        # finds segment boundaries with an identity check per block.
        self._blocks: dict[int, Records] = {}
        # Per endpoint, its keys from least to most recently written (capacity and drops).
        self._members: dict[str, WriteOrder] = {}
        # Per-endpoint capacity learned from the server's cache config (overrides the option).
        self._caps: dict[str, int] = {}
        self.stats = IndexStats()

    async def __aenter__(self) -> MemoryKVIndex:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def lookup(
        self,
        block_keys: Sequence[int],
        endpoints: Collection[str] | None = None,
        *,
        budget_s: float | None = None,  # answered at once: no wait to bound
    ) -> Lookup:
        self.stats.lookups += 1
        blocks = self._blocks
        segments: list[Segment] = []
        prev: Records | None = None
        walked = 0
        for key in block_keys:
            value = blocks.get(key)
            if value is None:
                break
            if value is not prev and value != prev:
                segments.append((walked, value))
                prev = value
            walked += 1
        if not segments:
            return EMPTY
        o = self._opt
        now_ms = int(o.clock() * 1000)
        matches = prefix_matches(segments, walked, now_ms, o.tier_weights, o.default_tier_weight)
        return Lookup(filter_matches(matches, endpoints))

    def record(self, endpoint: str, block_keys: Sequence[int]) -> bool:
        if not block_keys:
            return True
        ttl_ms = int(self._opt.approx_ttl_s * 1000)
        deadline = int(self._opt.clock() * 1000) + ttl_ms
        # A prefix re-recorded within a tenth of its TTL changes nothing that matters: its
        # whole chain was written together, so a fresh last block means a fresh chain. This
        # keeps the per-request cost of hot prefixes (shared system prompts) near zero.
        last = self._blocks.get(block_keys[-1])
        if last is not None:
            for tag, written in last:
                if tag == endpoint and written and written > deadline - ttl_ms // 10:
                    return True
        self._update(block_keys, endpoint, deadline)
        self._track(endpoint, block_keys)
        return True

    def store(
        self,
        endpoint: str,
        block_keys: Sequence[int],
        *,
        root: int,
        medium: str = GPU,
        group: GroupSpec = FULL_GROUP,
    ) -> bool:
        self._update(block_keys, entry_tag(endpoint, medium, group), 0)
        self._track(endpoint, block_keys)
        return True

    def remove(
        self,
        endpoint: str,
        block_keys: Sequence[int],
        *,
        root: int,
        medium: str = GPU,
        group: GroupSpec = FULL_GROUP,
        untrack: bool = True,
    ) -> bool:
        self._update(block_keys, entry_tag(endpoint, medium, group), None)
        if untrack and (members := self._members.get(endpoint)) is not None:
            members.discard(block_keys)
        return True

    def set_capacity(self, endpoint: str, blocks: int) -> None:
        """How many of our blocks `endpoint`'s KV cache holds: beyond it, the least recently
        written keys are taken to be evicted (applied at the endpoint's next write)."""
        self._caps[endpoint] = blocks

    def held_blocks(self, endpoint: str) -> int:
        """How many block keys `endpoint` is credited with (at most its capacity)."""
        members = self._members.get(endpoint)
        return len(members) if members is not None else 0

    async def remove_endpoint(self, endpoint: str) -> None:
        self._caps.pop(endpoint, None)
        members = self._members.pop(endpoint, None)
        if members:
            self._drop(endpoint, list(members))

    async def flush(self) -> None:
        return None

    async def run(self) -> None:
        """Nothing runs in the background; present so an App treats every backend alike."""
        await asyncio.Event().wait()

    async def aclose(self) -> None:
        return None

    def _update(self, keys: Sequence[int], tag: str, deadline: int | None) -> None:
        """Set (deadline given) or delete (None) one tag on every key.

        Bulk, not per key: chained keys come in runs that carry the same entries (a new
        chain is one run of "absent"), so the new value is computed once per run and the
        run is written with one C-level `dict.update`. A 1,500-block new chain costs two
        passes over the keys at C speed instead of a sort and a tuple per block."""
        blocks = self._blocks
        if deadline is not None and blocks.keys().isdisjoint(keys):
            # A new chain (the common case of a long new prompt): one pass to check, one
            # to write, no per-run bookkeeping.
            blocks.update(zip(keys, repeat(((tag, deadline),))))
            return
        olds = list(map(blocks.get, keys))
        start = 0
        # groupby compares identity first, so a run of one shared tuple is cheap to find.
        for old, run in groupby(olds):
            n = len(list(run))
            entries = dict(old) if old else {}
            if deadline is None:
                entries.pop(tag, None)
            else:
                entries[tag] = deadline
            span = keys[start : start + n]
            start += n
            if entries:
                blocks.update(zip(span, repeat(tuple(sorted(entries.items())))))
            elif old is not None:
                deque(map(blocks.pop, span, repeat(None)), maxlen=0)

    def _track(self, endpoint: str, keys: Sequence[int]) -> None:
        members = self._members.get(endpoint)
        if members is None:
            members = self._members[endpoint] = WriteOrder()
        members.touch(keys)
        cap = self._caps.get(endpoint, self._opt.capacity_blocks)
        if cap is not None and len(members) > cap:
            # One batch per write, not one eviction per key inserted.
            evicted = members.pop_oldest(len(members) - cap)
            self.stats.evicted_blocks += len(evicted)
            self._drop(endpoint, evicted)

    def _drop(self, endpoint: str, keys: Sequence[int]) -> None:
        """Remove every tag of `endpoint` (all media and groups) from `keys`; per run of
        keys sharing their entries, like `_update`."""
        blocks = self._blocks
        olds = list(map(blocks.get, keys))
        start = 0
        for old, run in groupby(olds):
            n = len(list(run))
            span = keys[start : start + n]
            start += n
            if old is None:
                continue
            new = tuple(e for e in old if parse_tag(e[0])[0] != endpoint)
            if len(new) == len(old):
                continue
            if new:
                blocks.update(zip(span, repeat(new)))
            else:
                deque(map(blocks.pop, span, repeat(None)), maxlen=0)
