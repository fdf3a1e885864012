"""The flow controller: per-band, per-flow queues in front of scheduling.

`await admit(request)` returns a `Ticket` at once while the pool has capacity and nothing
queued, else queues the request and returns when `dispatch()` releases it; it raises
`FlowRejected` when the request is shed (queue full, TTL expired, displaced by higher
priority). Cancelling the awaiting task (the client left, Envoy reset the stream) removes
the request from its queue at once. `release(ticket)` when the request ends frees capacity
and dispatches more.

Per-endpoint admission (`endpoints` given and a detector with `endpoint_saturation`): a
request is released only when, besides the pool being under its band's ceiling, some
endpoint stays under that ceiling with the request on it; the ticket names those endpoints
and the router places it on one. By the pool's average alone, a request was released while
the server it landed on was full, and its engine queued it (and interactive work behind it).

Dispatch: bands by priority (highest first), strictly: a lower band gets capacity only when
every higher band is empty, here and (with shared state) at every other replica. Within a
band the fairness policy picks the flow, the ordering policy the flow's request. Time comes
from an injected clock, so tests drive TTLs and decay by hand.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

from extproc.core import EndpointState
from extproc.flowcontrol.claims import Claims
from extproc.flowcontrol.detectors import EndpointDetector, SaturationDetector
from extproc.flowcontrol.eviction import EvictionSettings, Evictor
from extproc.flowcontrol.policies import (
    Arrival,
    FairnessPolicy,
    OrderingPolicy,
    StaticUsageLimit,
    TimedFairness,
    UsageLimitPolicy,
)
from extproc.flowcontrol.prefill_gate import PrefillGate
from extproc.flowcontrol.refill import CREDITS
from extproc.flowcontrol.reserve import BandPrior, Reserve
from extproc.flowcontrol.tickets import (
    EVICTED_PRESSURE,
    MAX_LABELLED_FLOWS,
    OUTCOMES,
    REJECTED_SATURATED,
    REJECTED_TTL,
    BandLimits,
    FlowRejected,
    FlowRequest,
    FlowStats,
    Ticket,
)

log = logging.getLogger("extproc.flowcontrol")
# An evictable request still running this long after its ext_proc stream ended (its end as
# the access log reports it, which lags the stream's close by the log's flush interval at
# most: 20 ms in the generated config, Envoy's default 1 s) could not be cut meanwhile.
UNCUT_AFTER_S = 1.5

__all__ = [
    "EVICTED_PRESSURE",
    "MAX_LABELLED_FLOWS",
    "OUTCOMES",
    "REJECTED_SATURATED",
    "REJECTED_TTL",
    "BandLimits",
    "FlowController",
    "FlowRejected",
    "FlowRequest",
    "FlowStats",
    "Ticket",
]


@dataclass(eq=False, slots=True)
class _Item:
    request: FlowRequest
    arrival: Arrival
    key: tuple[float, ...]
    future: asyncio.Future[Ticket]
    queued: bool = True
    # Found no endpoint with room at a dispatch opportunity (waiting_claims_room).
    waiting: bool = False
    # Per-endpoint eviction outcomes counted for this request (`evict_outcomes`): each at
    # most once, however many dispatch opportunities it waits through.
    evict_counted: tuple[str, ...] = ()

    def __lt__(self, other: _Item) -> bool:
        return self.key < other.key


@dataclass(slots=True)
class _Band:
    limits: BandLimits
    ordering: OrderingPolicy
    fairness: FairnessPolicy
    flows: dict[str, list[_Item]] = field(default_factory=dict)
    count: int = 0
    bytes: int = 0
    # Tokens queued per flow (the queue's share by weight, see _over_share).
    queued_tokens: dict[str, int] = field(default_factory=dict)


class FlowController:
    def __init__(
        self,
        *,
        detector: SaturationDetector,
        states: Callable[[], Sequence[EndpointState]],
        band: Callable[[int], tuple[BandLimits, OrderingPolicy, FairnessPolicy]],
        ttl_s: float = 60.0,
        max_requests: int = 0,
        max_bytes: int = 0,
        weights: Mapping[str, float] | None = None,
        usage_half_life_s: float = 30.0,
        usage_limit: UsageLimitPolicy | None = None,
        priorities: Sequence[int] = (),
        visibility_s: float = 0.1,
        eviction: EvictionSettings | None = None,
        endpoints: Callable[[], Sequence[tuple[str, EndpointState]]] | None = None,
        reserve: int = 0,
        prefill_speed: Callable[[], float | None] | None = None,
        reserve_priors: Mapping[int, BandPrior] | None = None,
        reserve_quantile: float = 0.0,
        reserve_rate_quantile: float = 0.0,
        reserve_refill_s: float = 0.0,
        reserve_refill_credit: str = "rate",
        reserve_refill_floor: float = 0.0,
        reserve_spike_s: float = 0.0,
        reserve_spike_quantile: float = 0.9,
        reserve_spike_joint: bool = False,
        gate: PrefillGate | None = None,
        waiting_claims_room: bool = False,
        dispatch_on_end: bool = False,
        engine_blocks: bool = False,
        engine_blocks_lower_bands: bool = False,
        evict_per_endpoint: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`states` gives the pool's endpoint states now; `band(priority)` the limits and
        policy instances for a band seen for the first time. `max_requests`/`max_bytes` bound
        all queues together (0 = only the per-band bounds). `usage_limit` gives each band its
        saturation ceiling (default: 1.0 for all); `priorities` are the configured bands.
        `visibility_s`: with a detector that reads scraped figures, how long a placed
        request still counts as pending (until a scrape can show it). `eviction`: cut
        running lower-band requests when a higher band is blocked (None: never).
        `endpoints`: (address, state) per endpoint now, for per-endpoint admission (None:
        by the pool's saturation alone). `reserve`: with per-endpoint admission, a lower
        band's request is released only where afterwards some endpoint still has room for
        that many of the largest recent requests of a higher band (0: no reserve), plus
        that band's arrival rate times their prefill time at `prefill_speed` (tokens/s, the
        fastest recently measured; None: unknown, the rate is left out). `reserve_priors`:
        per band, its expected largest request and arrival rate, counted until the band
        has a history of its own (flowcontrol/reserve.py). `reserve_quantile`: 0 for the
        largest recent requests, else that quantile of their sizes; `reserve_rate_quantile`:
        the rate term over that quantile of their prompts' prefill time (0: the size
        term's). `reserve_refill_s`: an endpoint may keep that much less of the reserve
        as it is expected to free within this many seconds, from the requests that ended
        there recently (0: none; flowcontrol/refill.py); `reserve_refill_credit`: how
        (`rate`: the recent ends' rate; `predicted`: the requests there predicted to end
        within it); `reserve_refill_floor`: the share of the reserve an endpoint keeps
        whatever the credit (0: none). `reserve_spike_s`: the rate term
        is instead the `reserve_spike_quantile` of the tokens a higher band sent within that
        many seconds before each of its recent requests (0: off); `reserve_spike_joint`:
        that quantile of each request's clump, its own tokens counted, or the largest
        requests, whichever is more. `gate`: with per-endpoint
        admission, a lower band's request starts only where the server's unfinished prefill
        stays short while a higher band is active (flowcontrol/prefill_gate.py).
        `waiting_claims_room`: with per-endpoint admission, in a band above the lowest, a
        request that found no room is tried before its band's newer requests, and the
        endpoint where it comes closest to fitting is kept for it from them
        (flowcontrol/claims.py). `dispatch_on_end`: a request's end (`ended`) is a
        dispatch opportunity at once, not at the next tick. `engine_blocks`: requests carry
        `engine_tokens` (what their engine holds for them, flowcontrol/engine_blocks.py) and
        the room checks count those: for the top band's requests, and for every band's the
        room the reserve keeps; a lower band's request itself fits by its tokens, as without
        (it may over-commit a server the reserve is not kept on: the engine queues it), unless
        `engine_blocks_lower_bands`. `evict_per_endpoint` (with `eviction` and per-endpoint
        admission): a band above the lowest whose request finds no endpoint with room gets
        lower-band requests cut on the endpoint where it comes closest to fitting, just
        enough to make its room, instead of llm-d's pool-wide sizing (`_reclaim_on`)."""
        self._detector = detector
        self._states = states
        self._band_of = band
        self.ttl_s = ttl_s
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.weights = dict(weights or {})
        self._half_life = usage_half_life_s
        self._clock = clock
        self._bands: dict[int, _Band] = {}
        self._seq = itertools.count()
        self.count = 0
        self.bytes = 0
        self.pending_requests = 0
        self.pending_tokens = 0
        # Tokens dispatched per flow, decayed; peers' figures are added by the shared state.
        self.served: dict[str, float] = {}
        self.peer_served: dict[str, float] = {}
        self.peer_top_band: int | None = None
        # Work other replicas released that the detector may not see yet (last exchange).
        self.peer_pending: tuple[int, int] = (0, 0)
        # Flows queued at other replicas, per band (last exchange), and how long this
        # replica leaves free capacity to a peer whose flow is next fleet-wide before it
        # serves its own queue anyway (0: never defers; set with shared state).
        self.peer_flows: dict[int, frozenset[str]] = {}
        self.defer_limit_s = 0.0
        self._deferring_since: float | None = None
        self.deferrals = 0
        # ... per band: on replicas, a band above the lowest deferring to a peer whose head
        # may not fit anywhere leaves this replica's higher-band work waiting for nothing.
        self.deferrals_by_band: dict[int, int] = {}
        self._decayed_at = clock()
        self.stats = FlowStats()
        self._usage_limit: UsageLimitPolicy = usage_limit or StaticUsageLimit()
        self._priorities: set[int] = set(priorities)
        self._visibility_s = visibility_s
        self._sees_placement = bool(getattr(detector, "sees_placement", True))
        self._settling: collections.deque[tuple[float, Ticket]] = collections.deque()
        # Every enqueued item in arrival order (one TTL for all: the oldest expire first);
        # items that left the queue are skipped lazily when they reach the front.
        self._arrivals: collections.deque[tuple[_Band, _Item]] = collections.deque()
        self.evictor = Evictor(eviction, clock) if eviction is not None else None
        self._endpoints = endpoints
        self._evict_per_endpoint = evict_per_endpoint and eviction is not None
        # Per-endpoint eviction by outcome, in waiting requests (each outcome once per
        # request, `_count_eviction`): `cut` (lower-band requests were cut for it), `short`
        # (no endpoint's lower-band requests could make its room: none cut).
        self.evict_outcomes: dict[str, int] = {"cut": 0, "short": 0}
        if endpoints is not None and not hasattr(detector, "endpoint_saturation"):
            log.warning(
                "per-endpoint admission off: detector %s has no per-endpoint figures; "
                "admitting by the pool's saturation alone",
                type(detector).__name__,
            )
            self._endpoints = None
        if evict_per_endpoint and (eviction is None or self._endpoints is None):
            log.warning(
                "flow_control.evict_per_endpoint has no effect without enableEviction and "
                "per-endpoint admission"
            )
            self._evict_per_endpoint = False
        # Released, not yet placed, per target endpoint: [requests, tokens].
        self._pending_at: dict[str, list[int]] = {}
        # Dispatch opportunities where the pool was under the ceiling but no endpoint had
        # room for the next request (it stayed queued).
        self.no_room = 0
        # ... of which some endpoint had room for the request but the reserve for higher
        # bands kept it (where goodput goes: bench/RESULTS.md, twelfth session).
        self.reserve_held = 0
        self.reserve_count = reserve
        self.reserve = Reserve(
            reserve,
            clock,
            reserve_priors,
            reserve_quantile,
            reserve_rate_quantile,
            reserve_spike_s,
            reserve_spike_quantile,
            reserve_spike_joint,
        )
        self._prefill_speed = prefill_speed
        credit = CREDITS[reserve_refill_credit]  # how the room about to free is counted
        self.refill = credit(reserve_refill_s, clock) if reserve_refill_s else None
        if not 0.0 <= reserve_refill_floor <= 1.0:
            raise ValueError(f"reserve_refill_floor {reserve_refill_floor} is not in 0..1")
        self.refill_floor = reserve_refill_floor
        # A detector that counts a constant output per in-flight request (the concurrency
        # detector's `outputTokens`) is told, per endpoint, how far the requests placed
        # there from this process differ from it: each counts its own expected output
        # (capped by its max_tokens), so a server of short answers is not judged full.
        self._base_out = int(getattr(detector, "output_per_request", 0))
        # Whether the detector counts a placed request's output at all: if not, a request's
        # room is its prompt alone (FlowRequest.counted_tokens says why one unit).
        self._counts_output = bool(getattr(detector, "counts_output", True))
        # address -> [requests, output difference, engine difference]
        self._out_at: dict[str, list[int]] = {}
        # With count_engine_blocks (flowcontrol/engine_blocks.py) each placed request counts
        # what its engine holds for it: the difference beyond its output's is kept beside it
        # in `_out_at`, and the other replicas' requests there (which only their own pickers
        # can size) count the mean difference of this replica's (`_peer_extra`).
        # Counted so, a lower band filling a server to its ceiling left it ~1% short of full
        # where by tokens it over-committed it by ~2% and the engine kept a small queue of
        # it: 0.014 goodput over five pairs (bench/RESULTS.md, twenty-first session). What
        # must fit is the top band's work: so a lower band's request fits by its tokens, and
        # only the room it must leave for the reserve (and the top band's own requests) is
        # counted as the engine holds it (`engine_blocks_lower_bands`: every band by blocks).
        self._engine_blocks = engine_blocks
        self._lower_by_blocks = engine_blocks_lower_bands
        self.gate = gate
        self.claims = Claims() if waiting_claims_room else None
        self._dispatch_on_end = dispatch_on_end
        # Dispatch opportunities taken at a request's end (dispatch_on_end).
        self.end_dispatches = 0
        # Evictable requests that ran on past their stream's end (`_uncut_check`).
        self.uncuttable = 0
        self._warned_uncuttable = False
        if gate is not None:
            gate.use_clock(clock)
            # (activeAtStart) the bands the operator gave a prior count as sending work.
            gate.started(reserve_priors or (), min(self._priorities, default=None))
        if gate is not None and self._endpoints is None:
            log.warning(
                "prefill-gate has no effect without per-endpoint admission "
                "(flow_control.admit_per_endpoint and a detector with per-endpoint figures)"
            )

    # -- admission -------------------------------------------------------------------------

    async def admit(self, request: FlowRequest) -> Ticket:
        now = self._clock()
        p = request.priority
        if request.output_counted and not self._counts_output:
            request = replace(request, output_counted=False)
        if self.reserve_count:
            self.reserve.note(p, request.counted_tokens, request.counted_output)
        if self.gate is not None:
            self.gate.arrived(p)
        if self.count == 0 and self._may_run(p) and self._open(p):
            room = self._room(request)
            if room is not None:
                return self._start(request, 0.0, room)
            self.no_room += 1
        band = self._band(request.priority)
        self._make_room(request, band)
        loop = asyncio.get_running_loop()
        arrival = Arrival(next(self._seq), now, self.ttl_s, request.slo_ttft_s)
        item = _Item(request, arrival, band.ordering.key(arrival), loop.create_future())
        heapq.heappush(band.flows.setdefault(request.fairness_id, []), item)
        if self.ttl_s:
            # Bounded: the front expires within the TTL (without one, nothing is kept).
            self._arrivals.append((band, item))
        band.count += 1
        band.bytes += request.body_bytes
        f = request.fairness_id
        band.queued_tokens[f] = band.queued_tokens.get(f, 0) + request.tokens
        self.count += 1
        self.bytes += request.body_bytes
        self.dispatch()
        try:
            return await item.future
        except asyncio.CancelledError:
            fut = item.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                # Released at the very moment the client left: give the capacity back.
                self.release(fut.result())
            elif item.queued:
                self._remove(band, item)
                self.stats.count(request, "cancelled")
            raise

    def _may_run(self, priority: int) -> bool:
        """Strict priority, fleet-wide: nothing of a higher band waits anywhere."""
        for p, b in self._bands.items():
            if p > priority and b.count:
                return False
        return self.peer_top_band is None or self.peer_top_band <= priority

    @property
    def detector(self) -> SaturationDetector:
        return self._detector

    def saturation(self, blocks: bool = True, less: tuple[int, int] = (0, 0)) -> float:
        """The pool's saturation; `blocks`: counting what the engines hold beyond the
        requests' tokens (count_engine_blocks), else by their tokens; `less`: (requests,
        tokens) taken off, as if they had ended (per-endpoint eviction's sizing)."""
        peer_reqs, peer_toks = self.peer_pending
        # Own placed requests' own outputs in place of the detector's constant, spread as
        # pending work is (exact for the average over endpoints of one size).
        out = sum(d + (e if blocks else 0) for _, d, e in self._out_at.values())
        return self._detector.saturation(
            self._states(),
            self.pending_requests + peer_reqs - less[0],
            self.pending_tokens + peer_toks + out - less[1],
        )

    def ceiling(self, priority: int, saturation: float = 0.0) -> float:
        """The saturation at which this band's work is held (usage-limit policy)."""
        self._priorities.add(priority)
        return self._usage_limit.ceiling(priority, tuple(self._priorities), saturation)

    def _open(self, priority: int) -> bool:
        """One dispatch opportunity for the band: may one of its requests start now?"""
        sat = self.saturation(self._by_blocks(priority))
        return sat < self.ceiling(priority, sat)

    def _by_blocks(self, priority: int) -> bool:
        """Whether a request of this band fits by what its engine holds (count_engine_blocks:
        the top band, or every band with `engine_blocks_lower_bands`), else by its tokens."""
        if not self._engine_blocks:
            return False
        return self._lower_by_blocks or priority >= max(self._priorities, default=priority)

    def _room(
        self, request: FlowRequest, waiting: bool = False
    ) -> tuple[str, frozenset[str]] | None:
        """Where the request may go: (the endpoint with the most room, every endpoint with
        room), or None when none has room for it under its band's ceiling. An endpoint with
        nothing on it always has room (else a request larger than the headroom would wait
        forever). With `reserve`, an endpoint has room for a lower band's request only if
        afterwards some endpoint (it or another) still has room for the largest recent
        request of a higher band: higher work finds a server free, not the head of a
        queue of lower work. Without per-endpoint admission: anywhere. With
        `waiting_claims_room`, room claimed by waiting requests counts as placed; the
        peers' claims not for a request `waiting` itself (flowcontrol/claims.py)."""
        if self._endpoints is None:
            return _ANYWHERE
        eps = self._endpoints()
        if not eps:
            return _ANYWHERE  # no endpoint at all: the router answers 503
        det = cast(EndpointDetector, self._detector)
        by_blocks = self._by_blocks(request.priority)
        sat = self.saturation(by_blocks)
        ceiling = self.ceiling(request.priority, sat)
        # What the request takes, in the unit its fit is counted in (and, counting engine
        # blocks, in the reserve's: what the engine will hold).
        size = request.room_tokens if by_blocks else request.counted_tokens
        held, top = (0, 0)
        if self.reserve_count:
            tps = self._prefill_speed() if self._prefill_speed is not None else None
            held, top = self.reserve.held(request.priority, self._priorities, tps)
        top_ceiling = self.ceiling(top, sat) if held else 0.0
        claimed = None
        if self.claims is not None:
            claimed = self.claims.against(request.priority, peers=not waiting)
        fits: list[tuple[float, str]] = []
        spare = 0  # endpoints with room for the reserved request as they are
        keeps: dict[str, bool] = {}  # ... with this request on it too
        has: dict[str, bool] = {}
        credits = 0
        peer_extra = self._peer_extra()
        for addr, state in eps:
            if self.refill is not None:
                self.refill.observe(addr, state)  # `started`: which requests decode there
            reqs, toks = self._pending_at.get(addr, _NONE)
            idle = det.endpoint_saturation(state, reqs, toks) == 0
            kept_for = claimed.get(addr, 0) if claimed else 0
            if kept_for:
                idle = False  # a waiting request's room: not free for this one
            toks = self._counted_at(addr, kept_for, state, peer_extra, by_blocks)
            after = det.endpoint_saturation(state, reqs + 1, toks + size)
            if after <= ceiling or idle:
                fits.append((after, addr))
            if held:
                if not by_blocks and self._engine_blocks:
                    # The room left for the higher band as its engine will hold it.
                    toks = self._counted_at(addr, kept_for, state, peer_extra, True)
                # Room about to free there counts toward the reserve (reserve_refill_s).
                credit = self.refill.credit(addr) if self.refill is not None else 0
                credits = max(credits, credit)
                # The floor: the `started` credit can reach nearly the whole reserve, and
                # the room it lends is not back when the band's next large request comes
                # (bench/RESULTS.md, twenty-sixth session, q99).
                kept = max(0, held - credit, int(held * self.refill_floor))
                has[addr] = idle or (
                    det.endpoint_saturation(state, reqs + 1, toks + kept) <= top_ceiling
                )
                spare += has[addr]
                keeps[addr] = (
                    det.endpoint_saturation(state, reqs + 2, toks + request.room_tokens + kept)
                    <= top_ceiling
                )
        if held and self.refill is not None:
            self.refill.last_credit = credits
        if held and fits:
            # On `a` the reserve holds if `a` keeps room for it, or another endpoint has it.
            fits = [(x, a) for x, a in fits if keeps[a] or spare - has[a] > 0]
            self.reserve_held += not fits
        if fits and self.gate is not None:
            fits = self._gated(request, fits, dict(eps))
        if not fits:
            return None
        return min(fits)[1], frozenset(a for _, a in fits)

    def _gated(
        self,
        request: FlowRequest,
        fits: list[tuple[float, str]],
        states: Mapping[str, EndpointState],
    ) -> list[tuple[float, str]]:
        """The prefill gate on the endpoints with room: a lower band's request only where
        the server's unfinished prefill stays short while a higher band is active; a
        higher band's request where the least is unfinished (flowcontrol/prefill_gate.py)."""
        gate = self.gate
        assert gate is not None
        p = request.priority
        if gate.active_above(p):
            prompt = request.prompt_tokens
            kept = [(x, a) for x, a in fits if gate.admits(gate.unfinished(a, states[a]), prompt)]
            if not kept:
                gate.note_held(p)
            return kept
        if gate.steers and self._priorities and p > min(self._priorities):
            left = {a: gate.unfinished(a, states[a]) for _, a in fits}
            least = min(left.values())
            return [(x, a) for x, a in fits if left[a] <= least]
        return fits

    def _band(self, priority: int) -> _Band:
        band = self._bands.get(priority)
        if band is None:
            limits, ordering, fairness = self._band_of(priority)
            band = self._bands[priority] = _Band(limits, ordering, fairness)
        return band

    def _make_room(self, request: FlowRequest, band: _Band) -> None:
        """Enforce the bounds for one more request: displace queued work of lower bands
        (newest first) when the global bound is what is hit, else shed the newcomer."""
        lim = band.limits
        while band.count + 1 > lim.max_requests or band.bytes + request.body_bytes > lim.max_bytes:
            victim = (
                self._over_share(band, request)
                if getattr(band.fairness, "displaces", False)
                else None
            )
            if victim is None:
                self.stats.count(request, "rejected_capacity")
                raise FlowRejected(
                    REJECTED_SATURATED, "the request queue for this priority is full"
                )
            self._remove(band, victim)
            self.stats.count(victim.request, "evicted_pressure")
            _fail(victim, FlowRejected(EVICTED_PRESSURE, "displaced by a tenant under its share"))
        while self._over_global(request.body_bytes):
            lower = self._newest_below(request.priority)
            if lower is None:
                self.stats.count(request, "rejected_capacity")
                raise FlowRejected(REJECTED_SATURATED, "the request queue is full")
            vband, item = lower
            self._remove(vband, item)
            self.stats.count(item.request, "evicted_pressure")
            _fail(
                item, FlowRejected(EVICTED_PRESSURE, "displaced from the queue by higher priority")
            )

    def _over_share(self, band: _Band, request: FlowRequest) -> _Item | None:
        """The newest queued request of the flow holding the most queued tokens per unit of
        weight, if the newcomer's flow, with the newcomer, would still hold less; never a
        flow's last one. So every backlogged flow keeps work queued for the usage-based pick.
        (By served usage instead, the flow just served a large request looked furthest over
        its share, lost its queue to newcomers, and had nothing queued when its turn came.)"""

        def norm(f: str, extra: int = 0) -> float:
            return (band.queued_tokens.get(f, 0) + extra) / self.weights.get(f, 1.0)

        flows = [f for f, q in band.flows.items() if f != request.fairness_id and len(q) > 1]
        if not flows:
            return None
        worst = max(flows, key=norm)
        if norm(worst) <= norm(request.fairness_id, request.tokens):
            return None
        return max(band.flows[worst], key=lambda i: i.arrival.seq)

    def _over_global(self, extra_bytes: int) -> bool:
        return bool(
            (self.max_requests and self.count + 1 > self.max_requests)
            or (self.max_bytes and self.bytes + extra_bytes > self.max_bytes)
        )

    def _newest_below(self, priority: int) -> tuple[_Band, _Item] | None:
        for p in sorted(self._bands):
            if p >= priority:
                return None
            band = self._bands[p]
            items = [i for q in band.flows.values() for i in q]
            if items:
                return band, max(items, key=lambda i: i.arrival.seq)
        return None

    def _remove(self, band: _Band, item: _Item) -> None:
        item.queued = False
        q = band.flows[item.request.fairness_id]
        q.remove(item)
        heapq.heapify(q)
        if not q:
            del band.flows[item.request.fairness_id]
        f = item.request.fairness_id
        left = band.queued_tokens.get(f, 0) - item.request.tokens
        if left > 0 and q:
            band.queued_tokens[f] = left
        else:
            band.queued_tokens.pop(f, None)
        band.count -= 1
        band.bytes -= item.request.body_bytes
        self.count -= 1
        self.bytes -= item.request.body_bytes

    # -- dispatch --------------------------------------------------------------------------

    def _start(
        self, request: FlowRequest, waited: float, room: tuple[str, frozenset[str]]
    ) -> Ticket:
        self.pending_requests += 1
        self.pending_tokens += request.room_tokens
        target, where = room
        if target:
            at = self._pending_at.setdefault(target, [0, 0])
            at[0] += 1
            at[1] += request.room_tokens
        f = request.fairness_id
        self.served[f] = self.served.get(f, 0.0) + request.tokens
        # One instant for the charge and the ticket: an eviction refund decays the charge
        # from `dispatched_at`.
        now = self._clock()
        fairness = self._band(request.priority).fairness
        if getattr(fairness, "timed", False):
            out = request.output_tokens
            cast(TimedFairness, fairness).charge(f, request.tokens - out, out, now)
        self.stats.count(request, "dispatched")
        k = (request.priority, self.stats.label(request.fairness_id))
        self.stats.wait_sum[k] = self.stats.wait_sum.get(k, 0.0) + waited
        self.stats.wait_count[k] = self.stats.wait_count.get(k, 0) + 1
        ticket = Ticket(request, waited, dispatched_at=now, endpoints=where, target=target)
        if self.gate is not None:
            self.gate.released(ticket, target, request.prompt_tokens)
        if self.evictor is not None:
            self.evictor.track(ticket, max(self._priorities, default=None))
        return ticket

    def dispatch(self) -> int:
        """Release queued requests while the pool has capacity; returns how many."""
        claims = self.claims
        if claims is None:
            return self._dispatch(None)
        claims.begin()
        try:
            return self._dispatch(claims)
        finally:
            claims.end()

    def _dispatch(self, claims: Claims | None) -> int:
        released = 0
        now = self._clock()
        # Flows of the top band whose head found no room at this opportunity, each holding
        # its claim (waiting_claims_room); the band's other flows may still go.
        stuck: set[tuple[int, str]] = set()
        while self.count:
            top = max(p for p, b in self._bands.items() if b.count)
            if self.peer_top_band is not None and self.peer_top_band > top:
                break  # a replica holds higher-priority work: that capacity is its to use
            if not self._open(top):
                self._deferring_since = None
                if self._evict_per_endpoint:
                    self._reclaim_for(self._bands[top])
                elif self.evictor is not None:
                    self._reclaim(top)
                break
            band = self._bands[top]
            flows = band.flows
            claiming = claims is not None and self._claims_for(top)
            if stuck:
                flows = {f: q for f, q in flows.items() if (top, f) not in stuck}
                if not flows:
                    break
            item = _oldest_waiting(flows) if claiming else None
            if item is None:
                served = self._fleet_served()
                heads = {f: q[0].key for f, q in flows.items()}
                if getattr(band.fairness, "timed", False):
                    arrivals = {f: q[0].arrival for f, q in flows.items()}
                    flow = cast(TimedFairness, band.fairness).pick_at(arrivals, now)
                else:
                    if self._defer_to_peer(top, band, heads, served, now):
                        break
                    flow = band.fairness.pick(heads, served, self.weights)
                item = flows[flow][0]
            self._deferring_since = None
            room = _ANYWHERE
            if not item.future.done():
                found = self._room(item.request, item.waiting)
                if found is None:
                    # The pool has room on average, but no server for this request: it
                    # waits here, not at the head of a full server's queue.
                    self.no_room += 1
                    if self._evict_per_endpoint:
                        if not stuck:
                            self._reclaim_on(item)
                    elif self.evictor is not None and not stuck:
                        self._reclaim(top)
                    if not claiming:
                        # Only this request, the band's pick, is offered a cut: the band
                        # leaves in pick order, so room made for one behind it would sit
                        # unused while this one fits nowhere (lower bands are kept off it),
                        # and a cut made for this one closes the eviction gate on that
                        # decision anyway: the next gets its offer once it is the pick.
                        break
                    assert claims is not None
                    item.waiting = True
                    claims.claim(self._closest(item.request), item.request.room_tokens)
                    stuck.add((top, item.request.fairness_id))
                    continue
                room = found
            self._remove(band, item)
            if item.future.done():
                # Its task was cancelled (the client left) and has not run its cleanup yet.
                self.stats.count(item.request, "cancelled")
                continue
            waited = now - item.arrival.enqueued
            ticket = self._start(item.request, waited, room)
            prev = self.stats.wait_max.get(top, 0.0)
            self.stats.wait_max[top] = max(prev, waited)
            item.future.set_result(ticket)
            released += 1
        return released

    def _claims_for(self, priority: int) -> bool:
        """Whether a band's waiting requests claim room: a band above the lowest (what a
        reserve is kept for), with per-endpoint admission."""
        return self._endpoints is not None and priority > min(self._priorities, default=priority)

    def _closest(self, request: FlowRequest) -> str:
        """The endpoint where the waiting request comes closest to fitting: the least
        saturated with it (and what is claimed there already) on it. Counted as `_room`
        counts for a waiting request (the one it gets at every later opportunity): the
        peers' claims left out. Its first `_room` call, before it was waiting, counted them
        (a newer request keeps off everyone's claims), so the server it claims may be one a
        peer claims too: from now on the two take room as it frees, as without claims
        (flowcontrol/claims.py)."""
        return self._closest_first(request)[0]

    def _closest_first(self, request: FlowRequest) -> list[str]:
        """The endpoints by how close the request comes to fitting on each, closest first
        (as `_closest` counts)."""
        assert self._endpoints is not None
        det = cast(EndpointDetector, self._detector)
        claimed = self.claims.against(request.priority, peers=False) if self.claims else {}
        afters: list[tuple[float, str]] = []
        peer_extra = self._peer_extra()
        by_blocks = self._by_blocks(request.priority)
        size = request.room_tokens if by_blocks else request.counted_tokens
        for addr, state in self._endpoints():
            reqs = self._pending_at.get(addr, _NONE)[0]
            toks = self._counted_at(addr, claimed.get(addr, 0), state, peer_extra, by_blocks)
            afters.append((det.endpoint_saturation(state, reqs + 1, toks + size), addr))
        return [a for _, a in sorted(afters)] or [""]

    def _counted_at(
        self,
        address: str,
        claimed: int,
        state: EndpointState,
        peer_extra: float,
        blocks: bool = True,
    ) -> int:
        """Tokens counted on an endpoint besides its in-flight figures, for `_room` and
        `_closest` alike: released to it and not placed yet, this process's placed
        requests' own outputs against the detector's constant (and, counting engine blocks
        with `blocks`, what their engine holds beyond that; the other replicas' requests
        there `peer_extra` each, `_peer_extra()` taken once per pass over the endpoints),
        and `claimed` (room kept there for waiting requests; tokens only: a claim is not a
        request on the server, it is the room one will take)."""
        own = self._out_at.get(address, _NONE3)
        extra = own[1]
        peers = 0
        if blocks:
            extra += own[2]
            if peer_extra:
                peers = round(max(0, state.inflight_requests - own[0]) * peer_extra)
        return self._pending_at.get(address, _NONE)[1] + extra + claimed + peers

    def _peer_extra(self) -> float:
        """The mean of what this replica's in-flight requests count beyond the detector's
        figures (count_engine_blocks): the other replicas' requests are counted by the
        detector alone (their prompt estimate and its output constant); the replicas get
        the same mix, so theirs are taken to differ as this one's do. 0 when not counting
        engine blocks."""
        if not self._engine_blocks:
            return 0.0
        n = total = 0
        for reqs, out, engine in self._out_at.values():
            n += reqs
            total += out + engine
        return total / n if n else 0.0

    def _defer_to_peer(
        self,
        priority: int,
        band: _Band,
        heads: Mapping[str, tuple[float, ...]],
        served: Mapping[str, float],
        now: float,
    ) -> bool:
        """Fleet-wide fairness: with a usage-based policy, the flow next by fleet-wide usage
        may be queued at another replica only; then this free capacity is left to that
        replica (it sees the same usage and capacity and releases it), for at most
        `defer_limit_s` (stale peer state must not leave capacity idle for long)."""
        peers = self.peer_flows.get(priority)
        if not peers or not self.defer_limit_s or not getattr(band.fairness, "fleet_wide", False):
            return False
        everywhere = dict(heads)
        for f in peers:
            everywhere.setdefault(f, (math.inf,))  # a tie goes to a local flow
        if band.fairness.pick(everywhere, served, self.weights) in heads:
            return False
        if self._deferring_since is None:
            self._deferring_since = now
            self.deferrals += 1
            self.deferrals_by_band[priority] = self.deferrals_by_band.get(priority, 0) + 1
        return now - self._deferring_since < self.defer_limit_s

    def top_flows(self) -> dict[int, list[str]]:
        """Per band, the flows queued here (published to the other replicas)."""
        return {p: list(b.flows) for p, b in self._bands.items() if b.flows}

    def _reclaim(self, priority: int) -> None:
        """Band `priority` has work but no room: evict running lower-band requests (paced,
        see flowcontrol/eviction.py). Their capacity returns when their streams end."""
        assert self.evictor is not None
        sat = self.saturation()
        for ticket in self.evictor.reclaim(sat, self.ceiling(priority, sat), priority):
            self._evicted(ticket)
            log.info(
                "evicted in flight",
                extra={
                    "priority": ticket.request.priority,
                    "fairness_id": ticket.request.fairness_id,
                    "for_priority": priority,
                },
            )

    def _reclaim_for(self, band: _Band) -> None:
        """The pool is at the band's ceiling: per-endpoint eviction for its oldest head."""
        heads = [q[0] for q in band.flows.values() if q]
        if heads:
            self._reclaim_on(min(heads, key=lambda i: i.arrival.seq))

    def _reclaim_on(self, item: _Item) -> None:
        """Per-endpoint eviction (`evict_per_endpoint`) for a request of a band above the
        lowest: on the endpoint where it comes closest to fitting, cut the lower bands'
        requests the order policy ranks first (the most recently dispatched: least work
        sunk), the fewest whose counted tokens bring it under its band's ceiling. When even all
        of them would not, the next closest endpoint where they would; none anywhere:
        nothing is cut (counted `short`). Paced as the pool-wide rule: nothing while a
        decision is outstanding. The room is made for this request, not kept for it: when
        the cut ones end, the next dispatch offers it to the queue's head, which is this
        request or one of its band before it."""
        request = item.request
        ev = self.evictor
        assert ev is not None and self._endpoints is not None
        p = request.priority
        if p <= min(self._priorities, default=p) or not ev.gate_open():
            return
        eps = dict(self._endpoints())
        order = self._closest_first(request)
        det = cast(EndpointDetector, self._detector)
        by_blocks = self._by_blocks(p)
        sat = self.saturation(by_blocks)
        ceiling = self.ceiling(p, sat)
        peer_extra = self._peer_extra()

        def fits(state: EndpointState, reqs: int, toks: int, k: int, freed: int) -> bool:
            # On the endpoint with `k` requests of `freed` tokens cut, and the pool's
            # dispatch check: the pool under the band's ceiling without the request, as
            # `_open` counts it.
            if det.endpoint_saturation(state, reqs - k, toks - freed) > ceiling:
                return False
            return self.saturation(by_blocks, (k, freed)) < ceiling

        for i, address in enumerate(order):
            state = eps.get(address)
            if state is None:
                continue
            # Counted there as if placed.
            reqs = self._pending_at.get(address, _NONE)[0] + 1
            toks = self._counted_at(address, 0, state, peer_extra, by_blocks)
            toks += request.room_tokens if by_blocks else request.counted_tokens

            if fits(state, reqs, toks, 0, 0):
                return  # room there already (it waits on the reserve or the gate)
            cut: list[Ticket] = []
            freed = 0
            for t in ev.candidates_on(address, p):
                cut.append(t)
                freed += t.request.room_tokens if by_blocks else t.request.counted_tokens
                if fits(state, reqs, toks, len(cut), freed):
                    break
            else:
                continue  # its lower bands cannot make the room: the next closest
            ev.cut(cut)
            self._count_eviction(item, "cut")
            for t in cut:
                self._evicted(t)
            log.info(
                "evicted in flight for room on an endpoint",
                extra={
                    "endpoint": address,
                    "closest": i == 0,
                    "evicted": len(cut),
                    "priorities": sorted({t.request.priority for t in cut}),
                    "for_priority": p,
                    "for_tokens": request.counted_tokens,
                },
            )
            return
        self._count_eviction(item, "short")

    def _evicted(self, ticket: Ticket) -> None:
        """A running request was cut: counted, and its dispatch charge taken back from its
        flow's served tokens (what it still weighs after the decay since), and from its
        program's attained service when its band uses a timed fairness
        (`program-aware-fairness`, which decays it with its own half-life). Its client got no
        answer (a 429, or a response cut short), so the fairness that counts tokens must not
        count them as served: newest-first eviction falls most on the flows with the largest
        requests, and without the refund each cut left such a flow further behind its weight
        (a 0.19 shortfall in one overload run, bench/RESULTS.md, issue 15, thirtieth
        session)."""
        request = ticket.request
        self.stats.count(request, "evicted_inflight")
        f = request.fairness_id
        fairness = self._band(request.priority).fairness
        if getattr(fairness, "timed", False):
            out = request.output_tokens
            cast(TimedFairness, fairness).refund(
                f, request.tokens - out, out, ticket.dispatched_at, self._clock()
            )
        if f not in self.served:
            return
        # `served` was decayed up to `_decayed_at`: the charge has lost as much since then.
        factor = self._decay_factor(self._decayed_at - ticket.dispatched_at)
        left = self.served[f] - request.tokens * factor
        if left >= 1.0:
            self.served[f] = left
        else:
            del self.served[f]

    def _count_eviction(self, item: _Item, outcome: str) -> None:
        """Count a per-endpoint eviction outcome once per waiting request: a request that
        finds nothing to cut is retried at every dispatch opportunity (each tick), so a count
        per attempt would grow with the tick rate and the wait, not with the requests eviction
        failed. One that found nothing and later got a cut counts both (the first says when
        it was stuck; a counter cannot take it back)."""
        if outcome not in item.evict_counted:
            item.evict_counted = (*item.evict_counted, outcome)
            self.evict_outcomes[outcome] += 1

    def _fleet_served(self) -> dict[str, float]:
        if not self.peer_served:
            return self.served
        out = dict(self.peer_served)
        for f, v in self.served.items():
            out[f] = out.get(f, 0.0) + v
        return out

    def placed(self, ticket: Ticket, address: str = "") -> None:
        """The router counted the request in flight on `address`. A detector reading
        in-flight counts sees it from now on; one reading scraped figures only after the
        next scrape, so until `visibility_s` has passed the request stays pending."""
        if ticket.placed or ticket.released:
            return
        ticket.placed = True
        ticket.endpoint = address
        if self.gate is not None:
            self.gate.placed(ticket, address)
        if self.refill is not None:
            ticket.freed_at = address
            req = ticket.request
            self.refill.placed(ticket, address, req.room_tokens, req.output_tokens)
        req = ticket.request
        if address and (self._base_out or req.engine_tokens):
            ticket.placed_at = address
            out = req.output_tokens - self._base_out if self._base_out else 0
            engine = 0
            if req.engine_tokens:
                # The detector counts its prompt estimate and the output constant; the
                # engine holds `engine_tokens` (in the detector's unit).
                prompt = req.tokens - req.output_tokens
                engine = req.engine_tokens - prompt - self._base_out - out
            ticket.counted_extra = out
            ticket.counted_blocks = engine
            at = self._out_at.setdefault(address, [0, 0, 0])
            at[0] += 1
            at[1] += out
            at[2] += engine
        if self._sees_placement:
            self._unpend(ticket)
        else:
            self._settling.append((self._clock(), ticket))

    def release(self, ticket: Ticket, *, output_held: bool = False, cuttable: bool = False) -> None:
        """The request ended (or never got placed): its capacity is free again.
        `output_held`: its in-flight count outlasts the ticket (held until the gateway's
        access log says the request ended, endpoints/request_end.py), so its own output
        keeps counting on its endpoint until `ended(ticket)`. `cuttable`: its response is
        still streaming through a stream that can cut it, so it stays an eviction candidate
        until `stream_ended(ticket)`."""
        if ticket.released:
            return
        ticket.released = True
        self._unpend(ticket)
        if self.gate is not None:
            self.gate.forget(ticket)
        if not output_held:
            self._ended(ticket)
        if self.evictor is not None and not cuttable:
            self._untrack(ticket)
        self.dispatch()

    def stream_ended(self, ticket: Ticket) -> None:
        """The ext_proc stream of a ticket released `cuttable` ended (its response is over,
        cut, or its client gone): it is no longer an eviction candidate, and an eviction of
        it is confirmed."""
        if self.evictor is not None:
            self._untrack(ticket)

    def _untrack(self, ticket: Ticket) -> None:
        assert self.evictor is not None
        self.evictor.untrack(ticket)
        if ticket.evictable and not ticket.evicted:
            ticket.uncut_since = self._clock()

    def _uncut_check(self, ticket: Ticket) -> None:
        """At an evictable request's end (its access-log entry): did it run on long after
        its stream ended, so that nothing could have cut it meanwhile? (The proxy closed the
        stream at the response headers: response body NONE with trailers SKIP.)"""
        since, ticket.uncut_since = ticket.uncut_since, 0.0
        if not since or self._clock() - since < UNCUT_AFTER_S:
            return
        self.uncuttable += 1
        if not self._warned_uncuttable:
            self._warned_uncuttable = True
            log.warning(
                "flow control eviction: an evictable request ran on %.1f s after its ext_proc "
                "stream ended, so nothing could cut it (the proxy ends the stream at the "
                "response headers; counted in extproc_flow_eviction_uncuttable_total): "
                "generate the Envoy config with `extproc envoy-config --response-trailers "
                "send` (docs/flow-control.md#eviction)",
                self._clock() - since,
            )

    def ended(self, ticket: Ticket) -> None:
        """The request is over on its endpoint (its in-flight count was just released):
        see `_ended`. With `dispatch_on_end` the room it freed is offered to the queue at
        once. Before, the next tick did (`tick_s`, 20 ms by default) unless an arrival came
        first: traced in the overload bench, a waiting interactive request was released
        a median 70-90 ms after the engine had freed its room, of which the gateway's
        access-log flush is most (bench/RESULTS.md, seventeenth session)."""
        self._uncut_check(ticket)
        self._ended(ticket)
        if self._dispatch_on_end and self.count:
            self.end_dispatches += 1
            self.dispatch()

    def _ended(self, ticket: Ticket) -> None:
        """The request is over on its endpoint: its own output stops counting there, as
        its in-flight count (and the detector's constant with it) does. Undone at the
        ticket's release instead, the correction lasted only until the ext_proc stream
        ended, at the response headers (before the prefill, for a streamed reply): for the
        rest of the request its output counted as the detector's constant while the engine
        held its own max_tokens (eleventh session, bench/RESULTS.md). Its tokens count as
        room its endpoint freed (`reserve_refill_s`). Idempotent."""
        if ticket.freed_at and self.refill is not None:
            self.refill.freed(ticket.freed_at, ticket.request.room_tokens, ticket)
        ticket.freed_at = ""
        address, ticket.placed_at = ticket.placed_at, ""
        at = self._out_at.get(address) if address else None
        if at is not None:
            at[0] -= 1
            at[1] -= ticket.counted_extra
            at[2] -= ticket.counted_blocks
            if at[0] <= 0:
                del self._out_at[address]

    def _unpend(self, ticket: Ticket) -> None:
        if ticket.pending:
            ticket.pending = False
            self.pending_requests -= 1
            self.pending_tokens -= ticket.request.room_tokens
            at = self._pending_at.get(ticket.target)
            if at is not None:
                at[0] -= 1
                at[1] -= ticket.request.room_tokens
                if at[0] <= 0:
                    del self._pending_at[ticket.target]

    # -- time ------------------------------------------------------------------------------

    def tick(self) -> None:
        """Periodic work: expire requests past their TTL, decay usage, dispatch what the
        latest endpoint figures allow."""
        now = self._clock()
        settling = self._settling
        while settling and now - settling[0][0] >= self._visibility_s:
            self._unpend(settling.popleft()[1])
        self._expire(now)
        self._decay(now)
        self.dispatch()

    def _expire(self, now: float) -> None:
        arrivals = self._arrivals
        while arrivals:
            band, item = arrivals[0]
            if item.queued:
                if now - item.arrival.enqueued < self.ttl_s:
                    return
                self._remove(band, item)
                self.stats.count(item.request, "evicted_ttl")
                _fail(item, FlowRejected(REJECTED_TTL, "the request waited too long in the queue"))
            arrivals.popleft()

    def _decay(self, now: float) -> None:
        dt = now - self._decayed_at
        if dt <= 0 or not self._half_life:
            return
        self._decayed_at = now
        factor = self._decay_factor(dt)
        self.served = {f: v * factor for f, v in self.served.items() if v * factor >= 1.0}

    def _decay_factor(self, dt: float) -> float:
        """What a served token still weighs `dt` seconds on (`usage_half_life_s`; 0: no
        decay)."""
        if dt <= 0 or not self._half_life:
            return 1.0
        return math.pow(0.5, dt / self._half_life)

    # -- introspection ---------------------------------------------------------------------

    def queued(self) -> dict[tuple[int, str], tuple[int, int]]:
        """(priority, fairness ID) -> (requests, bytes) queued now."""
        out: dict[tuple[int, str], tuple[int, int]] = {}
        for p, band in self._bands.items():
            for f, q in band.flows.items():
                out[(p, f)] = (len(q), sum(i.request.body_bytes for i in q))
        return out

    def program_service(self) -> dict[str, float]:
        """Per fairness ID, the attained service its timed fairness holds now
        (`program-aware-fairness`; summed over the plugin instances the bands name, each
        counted once however many bands share it)."""
        now = self._clock()
        out: dict[str, float] = {}
        seen: set[int] = set()
        for band in self._bands.values():
            policy = band.fairness
            if not getattr(policy, "timed", False) or id(policy) in seen:
                continue
            seen.add(id(policy))
            for f, v in cast(TimedFairness, policy).services(now).items():
                out[f] = out.get(f, 0.0) + v
        return out

    def oldest_wait(self) -> dict[int, float]:
        """Per band, how long its oldest queued request has waited."""
        now = self._clock()
        return {
            p: now - min(i.arrival.enqueued for q in b.flows.values() for i in q)
            for p, b in self._bands.items()
            if b.count
        }

    def top_band(self) -> int | None:
        """The highest band with queued requests here."""
        bands = [p for p, b in self._bands.items() if b.count]
        return max(bands) if bands else None

    def lowest_band(self) -> int | None:
        """The lowest band configured or seen (nothing is reserved for it)."""
        return min(self._priorities | set(self.reserve.bands()), default=None)

    def close(self, reason: str = "rejected-shutting-down") -> None:
        """Shed everything queued (on stop)."""
        for band in list(self._bands.values()):
            for q in list(band.flows.values()):
                for item in list(q):
                    self._remove(band, item)
                    _fail(item, FlowRejected(reason, "the picker is shutting down"))


_ANYWHERE: tuple[str, frozenset[str]] = ("", frozenset())


def _oldest_waiting(flows: Mapping[str, list[_Item]]) -> _Item | None:
    """The oldest of the flows' heads that found no room before (waiting_claims_room)."""
    waiting = [q[0] for q in flows.values() if q[0].waiting]
    return min(waiting, key=lambda i: i.arrival.seq) if waiting else None


_NONE = (0, 0)
_NONE3 = (0, 0, 0)


def _fail(item: _Item, exc: FlowRejected) -> None:
    if not item.future.done():  # a cancelled waiter needs no answer
        item.future.set_exception(exc)
