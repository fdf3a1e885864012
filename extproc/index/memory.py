"""In-process KV-block index: the embedded default, and the reference the Redis backend is
tested against (same contract suite).

Writes apply at once (no queue: they cost a few dict operations); one process only, so it
cannot share affinity between replicas. Not thread-safe: use it from one event loop.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Collection, Sequence
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

Records = tuple[tuple[str, int], ...]


class MemoryKVIndex:
    """A `KVIndex` held in this process (see `base.KVIndex` for the contract)."""

    def __init__(self, options: IndexOptions | None = None) -> None:
        self._opt = options if options is not None else IndexOptions()
        # Equal consecutive values are the same tuple object (see `_update`), so a lookup
        # finds segment boundaries with an identity check per block.
        self._blocks: dict[int, Records] = {}
        # Per endpoint, its keys from least to most recently written (capacity and drops).
        self._members: dict[str, OrderedDict[int, None]] = {}
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
        self, block_keys: Sequence[int], endpoints: Collection[str] | None = None
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
            for key in block_keys:
                members.pop(key, None)
        return True

    def set_capacity(self, endpoint: str, blocks: int) -> None:
        """How many of our blocks `endpoint`'s KV cache holds: beyond it, the least recently
        written keys are taken to be evicted (applied at the endpoint's next write)."""
        self._caps[endpoint] = blocks

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
        """Set (deadline given) or delete (None) one tag on every key."""
        blocks = self._blocks
        prev_old: Records | None = None
        prev_new: Records | None = None
        for key in keys:
            old = blocks.get(key)
            if old is not None and old is prev_old:
                new = prev_new
            else:
                entries = dict(old) if old else {}
                if deadline is None:
                    entries.pop(tag, None)
                else:
                    entries[tag] = deadline
                new = tuple(sorted(entries.items())) if entries else None
                prev_old, prev_new = old, new
            if new is None:
                blocks.pop(key, None)
            else:
                blocks[key] = new

    def _track(self, endpoint: str, keys: Sequence[int]) -> None:
        members = self._members.get(endpoint)
        if members is None:
            members = self._members[endpoint] = OrderedDict()
        # Tail first, so that under capacity pressure a prefix loses its tail before its head.
        for key in reversed(keys):
            members[key] = None
            members.move_to_end(key)
        cap = self._caps.get(endpoint, self._opt.capacity_blocks)
        if cap is not None and len(members) > cap:
            evicted = [members.popitem(last=False)[0] for _ in range(len(members) - cap)]
            self.stats.evicted_blocks += len(evicted)
            self._drop(endpoint, evicted)

    def _drop(self, endpoint: str, keys: Sequence[int]) -> None:
        """Remove every tag of `endpoint` (all media and groups) from `keys`."""
        blocks = self._blocks
        for key in keys:
            old = blocks.get(key)
            if old is None:
                continue
            new = tuple(e for e in old if parse_tag(e[0])[0] != endpoint)
            if new:
                blocks[key] = new
            else:
                del blocks[key]
