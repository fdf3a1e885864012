"""In-flight eviction (llm-d's `flowControl.enableEviction`): when a higher band cannot be
dispatched because the pool is saturated, requests already running in a lower band are cut
to make room, answered 429 with `x-llm-d-request-dropped-reason: evicted`.

Which running requests may be cut is the filter's call (`sheddable-eviction-filter`: only
sheddable ones, priority < 0); in which order, the order policy's
(`priority-then-time-eviction-order-policy`: lowest priority first, then the most recently
dispatched, which has the least KV-cache work sunk into it). llm-d wires exactly these two
(they take no parameters); GIE v1.5 names them `eviction-sheddable-filter` and
`eviction-priority-then-time-ordering`. Listing them in `plugins` is accepted; the switch is
`enableEviction`.

Sizing and pacing follow llm-d's reclamation rules, in saturation units: a decision frees
`max(1, ceil((saturation - ceiling) / (saturation / running)))` requests (at most
`max_per_decision`, 2), never one at or above the waiting band's priority; the next decision
waits until every evicted request's stream has ended (or `confirm_timeout_s` passed) and then
`grace_s` more, the time the detector needs to see the freed capacity (a few ms for in-flight
counts; a scrape plus the staleness bound plus the engine's abort for scraped figures), so
one blocked request does not cut the whole lower band before the detector can react.

What can be cut: a request whose ext_proc stream is still open (Envoy 1.40, observed):
- `extproc envoy-config` as generated (response body NONE, trailers SKIP): until the model
  server's response headers, which for a streamed reply come before the engine schedules
  it: nothing running can be cut.
- `--response-trailers send`: until the response's end. Envoy sends no trailers message
  (none came from the server) but keeps the stream open and resets it at the end.
- gateways with response body FULL_DUPLEX_STREAMED and trailers SEND: the response's end.
- a BUFFERED request body (response body NONE, trailers SKIP): the response's end (Envoy
  does not close the stream at the response headers then).
After the response headers the cut is a reset of the client's and the server's streams,
not a 429. The request's accounting ends where it did (FULL_DUPLEX_STREAMED request body
without response bodies: at the response headers); the controller keeps such a ticket a
candidate (`release(cuttable=True)`) until `stream_ended`, and counts an evictable request
still running 1.5 s after its stream ended as uncuttable
(`extproc_flow_eviction_uncuttable_total`, one warning).

Per endpoint (`flow_control.evict_per_endpoint`, opt-in): instead of the pool-wide sizing
above, a higher band's request that finds no endpoint with room gets room made on the one
endpoint where it comes closest to fitting: the controller asks `candidates_on` for the
requests of lower bands placed (or released) there, in the order policy's order, and cuts
(`cut`) the fewest of them whose counted tokens make the request fit under its band's
ceiling (where all of them would not, on the next closest endpoint; none anywhere: nothing
is cut, counted). The same stop-and-wait paces it. With
`lower-band-eviction-filter` every band below the highest configured one may be cut (never
one at or above the waiting request's band), where llm-d's filter allows sheddable
(priority < 0) requests only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

EVICTED = "evicted"  # llm-d's RequestDroppedReasonEvicted


class _NoParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class SheddableEvictionFilter:
    """Only sheddable requests (priority < 0) may be evicted."""

    type_name = "sheddable-eviction-filter"
    Params = _NoParams

    def __init__(self, params: Any = None) -> None:
        pass

    def accept(self, priority: int, top: int | None = None) -> bool:
        """`top`: the highest configured band (unused here)."""
        return priority < 0


class GieSheddableEvictionFilter(SheddableEvictionFilter):
    type_name = "eviction-sheddable-filter"


class LowerBandEvictionFilter:
    """Any request below the highest configured band may be evicted (extproc's; the
    waiting request's band, or above, is never cut whatever the filter says). For a
    fleet whose lowest band is batch at priority 0, which llm-d's filter never cuts."""

    type_name = "lower-band-eviction-filter"
    Params = _NoParams

    def __init__(self, params: Any = None) -> None:
        pass

    def accept(self, priority: int, top: int | None = None) -> bool:
        # No band configured: nothing is known to rank above anything, nothing is cut.
        return top is not None and priority < top


class PriorityThenTimeEvictionOrder:
    """Lowest priority first; among equals, the most recently dispatched first."""

    type_name = "priority-then-time-eviction-order-policy"
    Params = _NoParams

    def __init__(self, params: Any = None) -> None:
        pass

    def key(self, priority: int, dispatched_at: float) -> tuple[float, float]:
        """Smaller = evicted first."""
        return (priority, -dispatched_at)


class GiePriorityThenTimeEvictionOrder(PriorityThenTimeEvictionOrder):
    type_name = "eviction-priority-then-time-ordering"


EVICTION_FILTERS: tuple[type[Any], ...] = (
    SheddableEvictionFilter,
    GieSheddableEvictionFilter,
    LowerBandEvictionFilter,
)
EVICTION_ORDERS: tuple[type[Any], ...] = (
    PriorityThenTimeEvictionOrder,
    GiePriorityThenTimeEvictionOrder,
)
EVICTION_PLUGINS: tuple[type[Any], ...] = (*EVICTION_FILTERS, *EVICTION_ORDERS)


@dataclass(frozen=True, slots=True)
class EvictionSettings:
    """Resolved `enableEviction`: the policies, llm-d's decision cap and confirmation
    timeout, and the grace derived from the detector (see the module docstring)."""

    filter: SheddableEvictionFilter | LowerBandEvictionFilter = field(
        default_factory=SheddableEvictionFilter
    )
    order: PriorityThenTimeEvictionOrder = field(default_factory=PriorityThenTimeEvictionOrder)
    max_per_decision: int = 2
    grace_s: float = 0.01
    confirm_timeout_s: float = 10.0


@dataclass(slots=True)
class Evictor:
    """Running evictable requests, and the stop-and-wait pacing of eviction decisions."""

    settings: EvictionSettings
    clock: Callable[[], float]
    running: int = 0  # every running request this replica dispatched (the credit's divisor)
    _candidates: dict[Any, None] = field(default_factory=dict)  # insertion-ordered set
    _outstanding: dict[Any, float] = field(default_factory=dict)  # evicted -> when
    _cooling_until: float = 0.0

    def track(self, ticket: Any, top: int | None = None) -> None:
        """A request started: count it; keep it as a candidate when the filter accepts it
        (`top`: the highest configured band, for `lower-band-eviction-filter`)."""
        self.running += 1
        if self.settings.filter.accept(ticket.request.priority, top):
            ticket.evictable = True
            self._candidates[ticket] = None

    def untrack(self, ticket: Any) -> None:
        """A request ended (its stream closed): an evicted one confirms its eviction."""
        self.running = max(0, self.running - 1)
        self._candidates.pop(ticket, None)
        if self._outstanding.pop(ticket, None) is not None:
            self._cooling_until = max(self._cooling_until, self.clock() + self.settings.grace_s)

    def gate_open(self) -> bool:
        now = self.clock()
        timeout = self.settings.confirm_timeout_s
        for t, at in list(self._outstanding.items()):
            if now - at >= timeout:
                # Never confirmed (a stream that will not end): do not block eviction forever.
                del self._outstanding[t]
                self._cooling_until = max(self._cooling_until, now + self.settings.grace_s)
        return not self._outstanding and now >= self._cooling_until

    def reclaim(self, saturation: float, ceiling: float, demand_priority: int) -> list[Any]:
        """One decision for a band blocked at `ceiling`: the tickets to cut (their `evict`
        already called), none while the gate is closed."""
        if not self._candidates or self.running <= 0 or not self.gate_open():
            return []
        credit = saturation / self.running
        if credit <= 0 or math.isnan(credit) or math.isinf(credit):
            return []
        n = max(1, math.ceil((saturation - ceiling) / credit))
        n = min(n, self.settings.max_per_decision)
        victims = self._ranked(demand_priority)[:n]
        self.cut(victims)
        return victims

    def candidates_on(self, address: str, demand_priority: int) -> list[Any]:
        """The candidates on one endpoint (placed there, or released to it and not placed
        yet) below `demand_priority`, in the order they are to be cut; empty while the
        gate is closed (a decision outstanding)."""
        if not self._candidates or not self.gate_open():
            return []
        return self._ranked(demand_priority, address)

    def _ranked(self, demand_priority: int, address: str | None = None) -> list[Any]:
        """The candidates below `demand_priority` (on `address` only, when given: placed
        there, or released to it and not placed yet), in the order policy's order."""
        order = self.settings.order
        # Candidates are kept in dispatch order: a later one wins a tie on the clock.
        ranked = sorted(
            (
                (order.key(t.request.priority, t.dispatched_at), -i, t)
                for i, t in enumerate(self._candidates)
                if t.request.priority < demand_priority
                and (address is None or (t.endpoint or t.target) == address)
            ),
            key=lambda e: (e[0], e[1]),
        )
        return [t for _, _, t in ranked]

    def cut(self, victims: list[Any]) -> None:
        """Evict these candidates: one decision (the gate closes until every one of them
        has ended, then `grace_s`)."""
        now = self.clock()
        for t in victims:
            del self._candidates[t]
            self._outstanding[t] = now
            t.evict()
