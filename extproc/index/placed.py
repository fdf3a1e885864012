"""Precise mode: the picker's own placements, as a bounded correction to what the engines
reported.

Precise mode's index holds what the engines' KV events say they hold, and nothing else. At a
decision that is the truth at an instant between two others the picker also knows about:
- **Placed, not yet reported.** An engine publishes a prompt's blocks when it admits the
  request, after any queue; until then the index does not show the prefix on the endpoint
  the picker just sent it to, and the next request of the same group (a tenant's next
  conversation, a session's next turn) looks like a new prefix and is spread elsewhere.
- **Reported, about to be evicted.** Requests already placed on an endpoint but not yet
  admitted there will take KV blocks when admitted; a cache that cannot hold them and an
  idle session's tail evicts that tail (least recently used first). The index still shows
  the tail at the decision, the session stays, and by the time it is admitted its tail is
  gone: measured on the agentic workload, a session that stayed on a server carrying three
  found 2,912 of its 15,861 tokens cached though the index had matched 14,272 (issue 14).

`PlacedBlocks` keeps both corrections from the decisions this picker made:
- `pending`: each placement's blocks until the request ends (`settled`: the router calls it
  at the gateway's access-log entry; a stream's response headers come before its engine
  admits it) or `pending_s` at most; an endpoint is credited with the longer of the two
  matches. While the request runs its blocks are held by it: nothing evicts them.
- `resident`: every placement's blocks per endpoint, bounded by the endpoint's KV capacity
  and trimmed least recently placed first, tail before head (the approximate index's model
  of an LRU cache). Where it is full, a reported match longer than what it still holds is
  cut to it while work placed there is still in flight and shares less of the prompt: that
  work will evict the rest before this request is admitted. Work that has ended is in the
  events already (requests sent one after another are never cut: the engine's own LRU,
  which the events report, is the truth for them).
The index itself is never written: what the engines report stays what the index holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from extproc.core import common_prefix_blocks
from extproc.index.base import IndexOptions, Lookup
from extproc.index.memory import MemoryKVIndex

# Placed blocks credited at most this long without a response (a stream that never ends
# cleanly still stops counting).
PENDING_S = 30.0
# How long a placement is remembered for the residency model when no capacity is known;
# with capacities the model is bounded by them.
RESIDENT_TTL_S = 600.0
# Per-endpoint bound of the residency model before the endpoint's capacity is known
# (about 1M tokens at 16 per block): memory stays bounded without scraping.
DEFAULT_CAPACITY_BLOCKS = 65_536


@dataclass(slots=True)
class PlacedStats:
    """Decisions whose matches the picker's placements changed: `pending` raised an
    endpoint's match (blocks placed but not yet reported), `evicting` cut one (blocks the
    work placed since will evict)."""

    pending: int = 0
    evicting: int = 0


class _InFlight:
    """Placements not yet settled, by their first block key: only chains sharing a
    request's block 0 can share a prefix with it. Block keys are chained (each hashes its
    parent), so two chains agree up to some block and differ from there on: the common
    prefix is found by bisection, O(log n) per placement in flight on the same root, and a
    placement costs an append, not a write per block."""

    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self._ttl = ttl_s
        self._clock = clock
        self._by_root: dict[int, list[tuple[str, Sequence[int], float]]] = {}
        self._per_endpoint: dict[str, int] = {}
        self._added = 0

    def add(self, endpoint: str, keys: Sequence[int]) -> None:
        now = self._clock()
        self._by_root.setdefault(keys[0], []).append((endpoint, keys, now + self._ttl))
        self._per_endpoint[endpoint] = self._per_endpoint.get(endpoint, 0) + 1
        self._added += 1
        if self._added % 1024 == 0:
            # Placements never settled (a stream that vanished) go with their deadline.
            for root in list(self._by_root):
                self._prune(root, now)

    def remove(self, endpoint: str, keys: Sequence[int]) -> None:
        entries = self._by_root.get(keys[0])
        if not entries:
            return
        for i, (addr, held, _) in enumerate(entries):
            if addr == endpoint and (held is keys or held == keys):
                del entries[i]
                self._count(endpoint, -1)
                break
        if not entries:
            del self._by_root[keys[0]]

    def forget(self, endpoint: str) -> None:
        self._per_endpoint.pop(endpoint, None)
        for root, entries in list(self._by_root.items()):
            kept = [e for e in entries if e[0] != endpoint]
            if kept:
                self._by_root[root] = kept
            else:
                del self._by_root[root]

    def evicting(self, endpoint: str, keys: Sequence[int], n: float) -> bool:
        """Whether some placement in flight on `endpoint` shares less than `n` leading
        blocks with `keys`: when admitted it takes blocks of its own, which can evict the
        tail of `keys` (those sharing more need only what is held already)."""
        total = self._per_endpoint.get(endpoint, 0)
        if not total:
            return False
        covering = sum(
            1
            for addr, held, _ in self._by_root.get(keys[0], ())
            if addr == endpoint and common_prefix_blocks(keys, held) >= n
        )
        return total > covering

    def _count(self, endpoint: str, delta: int) -> None:
        n = self._per_endpoint.get(endpoint, 0) + delta
        if n > 0:
            self._per_endpoint[endpoint] = n
        else:
            self._per_endpoint.pop(endpoint, None)

    def matches(self, keys: Sequence[int]) -> dict[str, float]:
        if not keys or keys[0] not in self._by_root:
            return {}
        self._prune(keys[0], self._clock())
        out: dict[str, float] = {}
        for addr, held, _ in self._by_root.get(keys[0], ()):
            n = common_prefix_blocks(keys, held)
            if n > out.get(addr, 0.0):
                out[addr] = float(n)
        return out

    def _prune(self, root: int, now: float) -> None:
        entries = self._by_root.get(root)
        if entries and any(e[2] <= now for e in entries):
            for e in entries:
                if e[2] <= now:
                    self._count(e[0], -1)
            entries[:] = [e for e in entries if e[2] > now]
            if not entries:
                del self._by_root[root]


class PlacedBlocks:
    """See the module docstring. Event-loop only, like the memory index it uses."""

    def __init__(
        self, *, pending_s: float = PENDING_S, clock: Callable[[], float] = time.time
    ) -> None:
        self._pending = _InFlight(pending_s, clock)
        self._resident = MemoryKVIndex(
            IndexOptions(
                approx_ttl_s=RESIDENT_TTL_S,
                capacity_blocks=DEFAULT_CAPACITY_BLOCKS,
                clock=clock,
            )
        )
        self._caps: dict[str, int] = {}
        self.stats = PlacedStats()

    def set_capacity(self, endpoint: str, blocks: int) -> None:
        """`endpoint`'s KV cache in blocks (fed by the capacity model from its scrapes)."""
        self._caps[endpoint] = blocks
        self._resident.set_capacity(endpoint, blocks)

    def placed(self, endpoint: str, block_keys: Sequence[int]) -> None:
        if block_keys:
            self._pending.add(endpoint, block_keys)
            self._resident.record(endpoint, block_keys)

    def settled(self, endpoint: str, block_keys: Sequence[int]) -> None:
        """The request's response came (or its stream ended): its engine has published
        what it admitted, so the events speak for these blocks from now on."""
        if block_keys:
            self._pending.remove(endpoint, block_keys)

    async def forget(self, endpoint: str) -> None:
        """The endpoint left the pool or its cache was invalidated."""
        self._caps.pop(endpoint, None)
        self._pending.forget(endpoint)
        await self._resident.remove_endpoint(endpoint)

    async def adjust(self, block_keys: Sequence[int], found: Lookup) -> Lookup:
        """`found` (the index's answer) corrected by the placements, as the docstring says.
        A degraded answer is left alone: routing is on load then."""
        if found.degraded or not block_keys:
            return found
        pending = self._pending.matches(block_keys)
        resident = (await self._resident.lookup(block_keys)).matches
        matches = dict(found.matches)
        evicting = raised = False
        for addr, n in found.matches.items():
            cap = self._caps.get(addr)
            kept = resident.get(addr, 0.0)
            if (
                cap is not None
                and 0.0 < kept < n
                and self._resident.held_blocks(addr) >= cap
                and pending.get(addr, 0.0) < n
                and self._pending.evicting(addr, block_keys, n)
            ):
                matches[addr] = kept
                evicting = True
        for addr, n in pending.items():
            if n > matches.get(addr, 0.0) and n > found.matches.get(addr, 0.0):
                matches[addr] = n
                raised = True
        if not (evicting or raised):
            return found
        self.stats.evicting += evicting
        self.stats.pending += raised
        return Lookup(matches)
