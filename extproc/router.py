"""One routing decision, independent of the transport: parse the request, look its prefix up
in the KV-block index, gather candidates with their live state, run the scheduler, record
the placement.

`server/` feeds it headers and the body and turns its `Routed` into ext_proc messages;
the admin API's explain endpoint and the tests call it directly.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from extproc import protocol
from extproc.core import Candidate, Decision, Endpoint, EndpointState, InferenceRequest
from extproc.endpoints import EndpointPool, InFlight
from extproc.endpoints.inflight import InFlightCounter, Placement
from extproc.endpoints.prefill_speed import PrefillSpeeds
from extproc.endpoints.request_end import Ended, Late, RequestEnds
from extproc.errors import ExtprocError, NoEndpoints
from extproc.flowcontrol.controller import Ticket
from extproc.flowcontrol.engine_priority import EnginePriority
from extproc.hashing.tokenizer import PreciseKeys
from extproc.index.base import EMPTY, KVIndex, Lookup
from extproc.index.capacity import CapacityModel, CapacityStats
from extproc.index.placed import PlacedBlocks
from extproc.scheduling import Scheduler
from extproc.scheduling.framework import CacheCleared, EndpointReset, EstimateUnits
from extproc.throttle import Throttle

log = logging.getLogger("extproc.router")

Parser = Callable[[str, Mapping[str, str], bytes], InferenceRequest]


class StateSource(Protocol):
    """Live figures per endpoint (scraped metrics merged with in-flight counts)."""

    def state(
        self, address: str, inflight_requests: int, inflight_tokens: int
    ) -> EndpointState: ...


class InFlightOnly:
    """A StateSource for when no metrics are scraped: in-flight counts only."""

    def state(self, address: str, inflight_requests: int, inflight_tokens: int) -> EndpointState:
        return EndpointState(inflight_requests=inflight_requests, inflight_tokens=inflight_tokens)


class Admission(Protocol):
    """Flow control as the router sees it (extproc.flowcontrol.admission.Admission)."""

    # The band as the engine's priority, in the forwarded body or header (None: off).
    engine_priority: EnginePriority | None

    async def admit(self, request: InferenceRequest, uncached_tokens: int) -> Ticket: ...
    def placed(self, ticket: Ticket, address: str = "") -> None: ...
    def release(
        self, ticket: Ticket, *, output_held: bool = False, cuttable: bool = False
    ) -> None: ...
    def stream_ended(self, ticket: Ticket) -> None: ...
    def ended(self, ticket: Ticket) -> None: ...
    def evicted_error(self) -> ExtprocError: ...


def in_subset(address: str, subset: Collection[str]) -> bool:
    """GIE subset semantics: an `ip:port` entry admits that endpoint, an entry without a port
    admits every endpoint on that address."""
    if address in subset:
        return True
    host = address.rpartition(":")[0]
    return host.strip("[]") in subset


@dataclass(frozen=True, slots=True)
class Routed:
    """A decision plus what to undo or report when the request ends."""

    request: InferenceRequest
    decision: Decision
    placement: Placement
    lookup: Lookup
    ticket: Ticket | None = None  # flow-control admission, released at finish
    # time.monotonic() at the decision: response timing is measured from it.
    decided_at: float = 0.0
    # Seconds the index lookup took (0 without an index): the explanation reports it, so a
    # trace can tell a slow or degraded lookup from a wrong placement.
    lookup_s: float = 0.0


@dataclass(slots=True)
class RouterStats:
    """Counters the metrics exporter reads."""

    decisions: int = 0
    lookups_degraded: int = 0
    prefix_blocks_requested: int = 0
    prefix_blocks_matched: float = 0.0
    # Requests the proxy reports served by another endpoint than the pick.
    served_elsewhere: int = 0
    # Decisions whose response headers (session token, predicted TTFT) never reached the
    # client: the proxy skipped the response-header phase (envoy-config --response-headers).
    response_headers_unsent: int = 0
    # Flow-control tickets released at a stream that ended without response headers: the
    # admission slot and the eviction window closed at the decision, not at the response.
    admissions_without_response: int = 0


class Router:
    def __init__(
        self,
        *,
        pool: EndpointPool,
        scheduler: Scheduler,
        parser: Parser,
        inflight: InFlightCounter | None = None,
        index: KVIndex | None = None,
        precise: PreciseKeys | None = None,
        states: StateSource | None = None,
        is_failing: Callable[[str], bool] | None = None,
        record_decisions: bool = True,
        on_lookup: Callable[[float], None] | None = None,
        on_placed: Callable[[str, InferenceRequest], None] | None = None,
        ends: RequestEnds | None = None,
        speeds: PrefillSpeeds | None = None,
        admission: Admission | None = None,
        placed: PlacedBlocks | None = None,
        lookup_budget_follows_prefill: bool = False,
        capacity_first_tokens: int | None = None,
    ) -> None:
        """`on_lookup` receives each index lookup's duration in seconds (the metrics
        histogram); it runs on the hot path, so it must be cheap and must not raise.
        `ends` holds placements past the stream end until the request really ends (access
        log); `speeds` are the learned prefill speeds put on each candidate's state.
        `placed` (precise mode, where decisions are not recorded in the index) corrects
        the index's answers by this picker's own placements (index/placed.py).
        `lookup_budget_follows_prefill`: an index lookup may take as long as this request's
        prompt would take to prefill at the fleet's measured speed (see `_lookup_budget`).
        `capacity_first_tokens`: the KV-capacity model's first measurement early
        (index/capacity.py `CapacityModel`; None: off)."""
        self.pool = pool
        self.scheduler = scheduler
        self.inflight: InFlightCounter = inflight if inflight is not None else InFlight()
        self.index = index
        # `is None`, not truthiness: the scraped-state store is a container that is empty
        # until the first scrape, and `or` silently swapped it for in-flight counts only.
        self.states: StateSource = states if states is not None else InFlightOnly()
        self.stats = RouterStats()
        self._parse = parser
        self._precise = precise
        self._is_failing = is_failing
        self._record = record_decisions and index is not None
        self._on_lookup = on_lookup
        self._on_placed = on_placed
        self.ends = ends
        # Warnings about a proxy that skips the response-header phase: once a minute each.
        self._warnings = Throttle(every_s=60.0)
        self.speeds = speeds
        self.placed = placed if not self._record else None
        self._budget_follows_prefill = lookup_budget_follows_prefill
        set_capacity = getattr(index, "set_capacity", None)
        if self.placed is not None:
            set_capacity = self.placed.set_capacity
        self._capacity = (
            CapacityModel(
                set_capacity,
                getattr(self.states, "scraped", None),
                first_min_tokens=capacity_first_tokens,
            )
            if set_capacity is not None and (self._record or self.placed is not None)
            else None
        )
        # Flow control (None = off): holds a request after its lookup until capacity frees.
        self.admission = admission
        # Told (request id, completed) at each held request's end: calibration pairs the
        # engine's per-request count, made at a request's finish and never for a cut one,
        # with completed requests only (extproc/calibration.py).
        self.on_request_end: Callable[[str, bool], None] | None = None

    async def route(
        self,
        path: str,
        headers: Mapping[str, str],
        body: bytes | None,
        *,
        subset: Collection[str] | None = None,
        explain: bool = False,
        place: bool = True,
    ) -> Routed:
        """Decide where a request goes; `body=None` means the body is not available.
        Raises `BadRequest` for an unparseable request and `NoEndpoints` when nothing is
        eligible (an empty subset hint included). `place=False` decides without counting the
        request in flight or teaching the index (a dry run, for `explain`).

        Async because the prefix-index lookup is; scheduling itself never awaits."""
        request = self._request(path, headers, body)
        return await self.route_request(request, subset=subset, explain=explain, place=place)

    @property
    def capacity_stats(self) -> CapacityStats | None:
        """The KV-capacity model's figures (None when no index takes capacities)."""
        return self._capacity.stats if self._capacity is not None else None

    def peer_placed(self, address: str, tokens: int) -> None:
        """A peer replica placed a request of `tokens` estimated tokens (in this replica's
        unit) on `address`: the KV-capacity model measures real tokens per estimated token
        from every replica's placements (`state.shared_calibration`), as fast as one replica
        would, where alone it waited for 20,000 estimated tokens of its own share and
        credited each server meanwhile with what the 1.0 prior said."""
        if self._capacity is not None:
            self._capacity.peer_placed(address, tokens)

    def estimate_units_changed(self, factor: float) -> None:
        """Token estimates are now `factor` times larger (approximate keys recalibrated)."""
        self.inflight.units_changed(factor)
        if self._capacity is not None:
            self._capacity.units_changed(factor)
        if self.speeds is not None:
            self.speeds.units_changed(factor)
        for plugin in self.scheduler.plugins:
            if isinstance(plugin, EstimateUnits):
                plugin.units_changed(factor)

    def parse(self, path: str, headers: Mapping[str, str], body: bytes) -> InferenceRequest:
        """The CPU-bound half of `route` (parsing, block hashing), callable from a worker
        thread: it touches no shared state."""
        return self._request(path, headers, body)

    async def route_request(
        self,
        request: InferenceRequest,
        *,
        subset: Collection[str] | None = None,
        explain: bool = False,
        place: bool = True,
    ) -> Routed:
        """`route` for an already parsed request."""
        try:
            return await self._route_parsed(request, subset, explain, place)
        except ExtprocError as err:
            # Refused after parsing: the metrics label it with the model (llm-d's
            # request_error_total does).
            err.model = request.model
            raise

    def _lookup_budget(self, request: InferenceRequest) -> float | None:
        """How long the index lookup is worth waiting for: what it can save at most, the
        prefill of the whole prompt at the fleet's measured speed (a lookup answered
        degraded routes on load alone and may recompute all of it). A fixed 5 ms budget
        degraded up to 47% of a Redis index's lookups per benchmark step on a loaded 2-core
        machine, and every degraded lookup placed its request blind. None (the index's
        configured budget) until a speed is measured."""
        if not self._budget_follows_prefill or self.speeds is None:
            return None
        tps = self.speeds.fleet()
        return request.prompt_tokens / tps if tps else None

    async def _route_parsed(
        self,
        request: InferenceRequest,
        subset: Collection[str] | None,
        explain: bool,
        place: bool,
    ) -> Routed:
        endpoints = self._eligible(subset)
        lookup = EMPTY
        lookup_s = 0.0
        if self.index is not None and request.block_keys:
            start = time.perf_counter()
            lookup = await self.index.lookup(
                request.block_keys, budget_s=self._lookup_budget(request)
            )
            lookup_s = time.perf_counter() - start
            if self._on_lookup is not None:
                self._on_lookup(lookup_s)
            if lookup.degraded:
                self.stats.lookups_degraded += 1
            if self.placed is not None:
                lookup = await self.placed.adjust(request.block_keys, lookup)
        matches = lookup.matches
        if self.admission is None or not place:
            return self._decide(request, endpoints, lookup, explain, place, None, lookup_s)
        best = max(matches.values(), default=0.0)
        ticket = await self.admission.admit(
            request, request.prompt_tokens - int(best * request.block_tokens)
        )
        try:
            if ticket.waited_s > 0:
                endpoints = self._eligible(subset)  # the pool may have changed while it waited
            if ticket.endpoints:
                # Per-endpoint admission released it where it fits: place it there.
                endpoints = (
                    tuple(e for e in endpoints if e.address in ticket.endpoints) or endpoints
                )
            routed = self._decide(request, endpoints, lookup, explain, place, ticket, lookup_s)
        except BaseException:
            self.admission.release(ticket)
            raise
        self.admission.placed(ticket, routed.placement.address)
        return routed

    def routable(self) -> tuple[Endpoint, ...]:
        """The endpoints a request without a subset may be placed on now (empty: none).
        Flow control's per-endpoint admission judges these: releasing a request for a
        server the router then routes around placed it on another, full one."""
        try:
            return self._eligible(None)
        except NoEndpoints:
            return ()

    def _eligible(self, subset: Collection[str] | None) -> tuple[Endpoint, ...]:
        endpoints = self.pool.snapshot()
        if subset is not None:
            endpoints = tuple(e for e in endpoints if in_subset(e.address, subset))
        if not endpoints:
            raise NoEndpoints("no model-server endpoint is eligible for this request")
        failing = self._is_failing
        if failing is not None:
            # A server that stopped answering its metrics is probably gone; route around it,
            # unless every endpoint looks that way (then metrics are the problem, not them).
            healthy = tuple(e for e in endpoints if not failing(e.address))
            if healthy:
                endpoints = healthy
        return endpoints

    def _decide(
        self,
        request: InferenceRequest,
        endpoints: tuple[Endpoint, ...],
        lookup: Lookup,
        explain: bool,
        place: bool,
        ticket: Ticket | None,
        lookup_s: float = 0.0,
    ) -> Routed:
        """Scheduling proper: synchronous, so nothing changes between state and placement."""
        matches = lookup.matches
        inflight, states = self.inflight, self.states
        speeds = self.speeds if self.speeds is not None and self.speeds.samples else None
        cands = []
        for e in endpoints:
            a = e.address
            state = states.state(a, inflight.requests(a), inflight.tokens(a))
            if speeds is not None:
                state = state.with_prefill_tps(speeds.get(a))
            cands.append(
                Candidate(
                    endpoint=e,
                    state=state,
                    prefix_blocks=matches.get(a, 0.0),
                    prefix_known=not lookup.degraded,
                )
            )
        decision = self.scheduler.schedule(request, cands, explain=explain)
        if not decision.endpoints:
            raise NoEndpoints("no model-server endpoint is eligible for this request")
        if not place:
            return Routed(
                request, decision, Placement(decision.primary.address, 0), lookup, lookup_s=lookup_s
            )
        self.scheduler.observe(request, cands, decision)
        if self._record and self.index is not None:
            if self._capacity is not None:
                self._capacity.placed(decision.primary.address, request)
                self._capacity.update(request, cands)
            self.index.record(decision.primary.address, request.block_keys)
            if decision.prefill is not None:
                self.index.record(decision.prefill.address, request.block_keys)
        elif self.placed is not None and request.block_keys:
            if self._capacity is not None:
                self._capacity.placed(decision.primary.address, request)
                self._capacity.update(request, cands)
            self.placed.placed(decision.primary.address, request.block_keys)
        matched = matches.get(decision.primary.address, 0.0)
        stats = self.stats
        stats.decisions += 1
        stats.prefix_blocks_requested += len(request.block_keys)
        stats.prefix_blocks_matched += matched
        # In-flight tokens measure prefill work placed: the part of the prompt the endpoint
        # does not already hold.
        uncached = max(0, request.prompt_tokens - int(matched * request.block_tokens))
        placement = inflight.acquire(decision.primary.address, uncached)
        if self._on_placed is not None:
            self._on_placed(decision.primary.address, request)
        return Routed(request, decision, placement, lookup, ticket, time.monotonic(), lookup_s)

    def _request(
        self, path: str, headers: Mapping[str, str], body: bytes | None
    ) -> InferenceRequest:
        if body is None:
            # The proxy never shows us this body (body mode NONE/STREAMED): route on headers.
            return InferenceRequest(
                request_id=headers.get(protocol.REQUEST_ID_HEADER, ""), path=path, headers=headers
            )
        request = self._parse(path, headers, body)
        if self._precise is not None and request.prompt is not None:
            keys, tokens = self._precise.prompt_keys(request)
            # The engine's token count, not the byte estimate: matches are in engine tokens.
            request = dataclasses.replace(
                request,
                block_keys=keys,
                block_tokens=self._precise.block_size,
                prompt_tokens=tokens or request.prompt_tokens,
            )
        return request

    def responded(self, routed: Routed) -> None:
        """The model server's response headers came back through the proxy: tell the
        plugins that learn from response timing (the latency model). Not when another
        endpoint served it (a retry's timing includes the failed attempt)."""
        if routed.decided_at and routed.placement.address == routed.decision.primary.address:
            self.scheduler.responded(
                routed.request, routed.decision, time.monotonic() - routed.decided_at
            )

    def served(self, routed: Routed, address: str) -> Routed:
        """The proxy reports `address` served the request (a fallback after a retry, or its
        own choice): its in-flight count and the index follow the served endpoint. Returns
        the Routed to finish later."""
        old = routed.placement
        if address == old.address:
            return routed
        self.stats.served_elsewhere += 1
        self._settle(routed)
        self.inflight.release(old)
        placement = self.inflight.acquire(address, old.tokens)
        if self._record and self.index is not None:
            self.index.record(address, routed.request.block_keys)
        return dataclasses.replace(routed, placement=placement)

    def _settle(self, routed: Routed) -> None:
        if self.placed is not None and routed.decision.endpoints:
            self.placed.settled(routed.decision.primary.address, routed.request.block_keys)

    def _settle_late(self, routed: Routed, then: Late | None) -> Late | None:
        """`then`, settling the placement's credit first when the request has ended. Keeps
        the pick and the block keys only, not the request (held to the request's end)."""
        if self.placed is None or not routed.decision.endpoints:
            return then
        pick = routed.decision.primary.address
        return functools.partial(self._settle_then, pick, routed.request.block_keys, then)

    def _settle_then(
        self, pick: str, keys: Sequence[int], then: Late | None, entry: Ended | None
    ) -> None:
        if self.placed is not None:
            self.placed.settled(pick, keys)
        if then is not None:
            then(entry)

    async def forget_endpoint(self, address: str) -> None:
        """`address` left the pool, or its cache was invalidated (a restart): what this
        picker placed there no longer counts, in the index or in the plugins' figures."""
        if self.placed is not None:
            await self.placed.forget(address)
        for plugin in self.scheduler.plugins:
            if isinstance(plugin, EndpointReset):
                plugin.endpoint_reset(address)

    def cache_cleared(self, address: str) -> None:
        """`address`'s engine emptied its prefix cache and kept running (precise mode hears
        it as AllBlocksCleared; the index has dropped its entries): no plugin counts what was
        written there before. The placements' residency model (index/placed.py) is left as
        it is: it trims the least recently placed first, so what was placed before the
        clear goes before anything placed after, and it cuts a match only once the
        placements since have trimmed it."""
        for plugin in self.scheduler.plugins:
            if isinstance(plugin, CacheCleared):
                plugin.cache_cleared(address)

    def _unseen(self, routed: Routed, then: Late | None) -> Late:
        """What a request whose response headers the picker never saw needs from its
        access-log entry, keeping only that: the hold lasts the whole request, so no prompt,
        and block keys only when a fallback could serve it."""
        keys = routed.request.block_keys if len(routed.decision.endpoints) > 1 else ()
        learn = routed if routed.decided_at and self.scheduler.learns_from_responses else None
        unsent = tuple(sorted(routed.decision.response_headers))
        return functools.partial(
            self._ended_unseen, routed.placement.address, keys, learn, unsent, then
        )

    def _ended_unseen(
        self,
        pick: str,
        keys: Sequence[int],
        learn: Routed | None,
        unsent: tuple[str, ...],
        then: Late | None,
        entry: Ended | None,
    ) -> None:
        """The access-log entry (None: none came): the index follows the endpoint that
        served (the in-flight count was released with the hold), plugins learning from
        response timing get the time to the first byte, decision response headers that
        could not be sent are counted; `then` sees the entry last."""
        if entry is not None:
            if entry.upstream and entry.upstream != pick:
                self.stats.served_elsewhere += 1
                if keys and self._record and self.index is not None:
                    self.index.record(entry.upstream, keys)
            elif learn is not None and entry.ttfb_s is not None:
                self.scheduler.responded(learn.request, learn.decision, entry.ttfb_s)
            if unsent and entry.status is not None:
                self._count_unsent(unsent)
        if then is not None:
            then(entry)

    def _admission_unseen(self) -> None:
        self.stats.admissions_without_response += 1
        if self._warnings.allow("admission") is not None:
            log.warning(
                "flow control with a stream that ended before the response headers: if the "
                "proxy skips that phase, admission slots and eviction end at the decision; "
                "generate its config with `extproc envoy-config --response-headers send`",
                extra={"total": self.stats.admissions_without_response},
            )

    def _count_unsent(self, names: tuple[str, ...]) -> None:
        self.stats.response_headers_unsent += 1
        if self._warnings.allow("unsent") is not None:
            log.warning(
                "decision response headers (%s) not sent: the proxy skips the "
                "response-header phase; generate its config with "
                "`extproc envoy-config --response-headers send`",
                ", ".join(names),
                extra={"unsent_total": self.stats.response_headers_unsent},
            )

    def finish(
        self,
        routed: Routed,
        *,
        responded: bool = True,
        then: Late | None = None,
        cuttable: bool = False,
    ) -> None:
        """The request's ext_proc stream ended (response headers seen, response done, client
        gone, or error): release its placement, or hold it until the access log says the
        request itself ended (see `endpoints/request_end.py`). `responded=False`: the stream
        never saw the response headers (the proxy skips that phase), so the access-log entry
        reports what they would have (see `_ended_unseen`; `then` sees the entry, or None,
        once the request is over). `cuttable`: the stream outlives this call, and flow
        control may still evict the request until `admission.stream_ended(ticket)`."""
        if self.ends is not None:
            # Placed blocks are credited until the request ends (the response headers of a
            # stream come before its engine admits it and publishes its blocks); while it
            # runs they are held by it, so nothing evicts them.
            if responded:
                late = self._settle_late(routed, None)
            else:
                late = self._unseen(routed, self._settle_late(routed, then))
            if routed.ticket is not None and self.admission is not None:
                # Flow control counts the request's own output as long as its in-flight
                # count lasts: to the request's end, not the stream's.
                late = functools.partial(_ticket_ended, self.admission, routed.ticket, late)
            if self.on_request_end is not None:
                late = functools.partial(_request_ended, self.on_request_end, routed, late)
            self.ends.finish(routed.request.request_id, routed.placement, late)
            if responded and then is not None:
                then(None)
        else:
            self.inflight.release(routed.placement)
            self._settle(routed)
            if then is not None:
                then(None)
        if routed.ticket is not None and self.admission is not None:
            if not responded:
                self._admission_unseen()
            self.admission.release(
                routed.ticket, output_held=self.ends is not None, cuttable=cuttable
            )


def _request_ended(
    tell: Callable[[str, bool], None], routed: Routed, then: Late | None, entry: Ended | None
) -> None:
    """A held request's end: completed when its access-log entry says it ran to its end (a
    2xx status, or none logged, and no response flag that says it stopped short: a client's
    hang-up is logged with the 200 already sent) and flow control did not cut it; no entry
    in time is no completion known."""
    ticket = routed.ticket
    completed = (
        entry is not None and entry.completed and not (ticket is not None and ticket.evicted)
    )
    tell(routed.request.request_id, completed)
    if then is not None:
        then(entry)


def _ticket_ended(
    admission: Admission, ticket: Ticket, then: Late | None, entry: Ended | None
) -> None:
    """A held request's end (its access-log entry, or none in time): flow control stops
    counting its output; then what else waited for the entry."""
    admission.ended(ticket)
    if then is not None:
        then(entry)
