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
- `pending`: each placement's blocks until the request's stream ends at its response (its
  prompt was admitted and published by then) or `pending_s` at most; an endpoint is
  credited with the longer of the two matches.
- `resident`: every placement's blocks per endpoint, bounded by the endpoint's KV capacity
  and trimmed least recently placed first, tail before head (the approximate index's model
  of an LRU cache). Where it is full, a reported match longer than what it still holds is
  cut to it: the work placed since will evict the rest before this request is admitted.
The index itself is never written: what the engines report stays what the index holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


class PlacedBlocks:
    """See the module docstring. Event-loop only, like the memory index it uses."""

    def __init__(
        self, *, pending_s: float = PENDING_S, clock: Callable[[], float] = time.time
    ) -> None:
        self._pending = MemoryKVIndex(IndexOptions(approx_ttl_s=pending_s, clock=clock))
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
        self._pending.record(endpoint, block_keys)
        self._resident.record(endpoint, block_keys)

    def settled(self, endpoint: str, block_keys: Sequence[int]) -> None:
        """The request's response came (or its stream ended): its engine has published
        what it admitted, so the events speak for these blocks from now on."""
        if block_keys:
            self._pending.remove(endpoint, block_keys, root=block_keys[0])

    async def forget(self, endpoint: str) -> None:
        """The endpoint left the pool or its cache was invalidated."""
        self._caps.pop(endpoint, None)
        await self._pending.remove_endpoint(endpoint)
        await self._resident.remove_endpoint(endpoint)

    async def adjust(self, block_keys: Sequence[int], found: Lookup) -> Lookup:
        """`found` (the index's answer) corrected by the placements, as the docstring says.
        A degraded answer is left alone: routing is on load then."""
        if found.degraded or not block_keys:
            return found
        pending = (await self._pending.lookup(block_keys)).matches
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
