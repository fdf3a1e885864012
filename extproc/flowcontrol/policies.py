"""Queue policies: which flow of a band goes next (fairness), and which of a flow's requests
(ordering). llm-d's type names; `weighted-token-fairness-policy` is ours, the one that counts
tokens.

Ordering policies turn a queued item into a sort key (smallest first); fairness policies
choose among the band's non-empty flows, given each flow's head key and the tokens each flow
has been served (decayed, fleet-wide when shared through Redis).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol

import msgspec

_Pos = Annotated[float, msgspec.Meta(gt=0)]


@dataclass(frozen=True, slots=True)
class Arrival:
    """What ordering needs to know about a queued request."""

    seq: int
    enqueued: float
    ttl_s: float  # 0 = no TTL
    slo_ttft_s: float | None = None


class OrderingPolicy(Protocol):
    def key(self, item: Arrival) -> tuple[float, ...]: ...


class FairnessPolicy(Protocol):
    def pick(
        self,
        heads: Mapping[str, tuple[float, ...]],
        served: Mapping[str, float],
        weight: Mapping[str, float],
    ) -> str:
        """One of `heads`' flow IDs (never called with none)."""
        ...


class TimedFairness(FairnessPolicy, Protocol):
    """A fairness policy whose class says `timed = True`: the controller picks among the
    flows' oldest arrivals at a time, charges each dispatch to its flow, takes the charge
    of a request cut by eviction back (`refund`, given when it was charged) and reports
    each flow's decayed service (`services`, for a gauge)."""

    def pick_at(self, heads: Mapping[str, Arrival], now: float) -> str: ...

    def charge(self, flow: str, input_tokens: int, output_tokens: int, now: float) -> None: ...

    def refund(
        self, flow: str, input_tokens: int, output_tokens: int, charged_at: float, now: float
    ) -> None: ...

    def services(self, now: float) -> dict[str, float]: ...


class _NoParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class FCFSOrdering:
    """`fcfs-ordering-policy` (default): first come, first served within a flow."""

    type_name = "fcfs-ordering-policy"
    Params = _NoParams

    def __init__(self, params: _NoParams | None = None) -> None:
        pass

    def key(self, item: Arrival) -> tuple[float, ...]:
        return (float(item.seq),)


class EDFOrdering:
    """`edf-ordering-policy`: earliest deadline (enqueue time + TTL) first; requests without a
    TTL go after every request with one, FCFS between equals."""

    type_name = "edf-ordering-policy"
    Params = _NoParams

    def __init__(self, params: _NoParams | None = None) -> None:
        pass

    def key(self, item: Arrival) -> tuple[float, ...]:
        deadline = item.enqueued + item.ttl_s if item.ttl_s > 0 else math.inf
        return (deadline, float(item.seq))


class SLODeadlineOrdering:
    """`slo-deadline-ordering-policy`: earliest TTFT deadline first, from the request's
    `x-llm-d-slo-ttft-ms` header (enqueue time + SLO); requests without one go last, FCFS."""

    type_name = "slo-deadline-ordering-policy"
    Params = _NoParams

    def __init__(self, params: _NoParams | None = None) -> None:
        pass

    def key(self, item: Arrival) -> tuple[float, ...]:
        slo = item.slo_ttft_s
        return (item.enqueued + slo if slo is not None else math.inf, float(item.seq))


class GlobalStrictFairness:
    """`global-strict-fairness-policy` (llm-d's default): flows are ignored; the band's best
    request by the ordering policy goes next, whichever flow holds it."""

    type_name = "global-strict-fairness-policy"
    Params = _NoParams

    def __init__(self, params: _NoParams | None = None) -> None:
        pass

    def pick(self, heads, served, weight) -> str:
        return min(heads, key=heads.__getitem__)


class RoundRobinFairness:
    """`round-robin-fairness-policy`: one request per flow in turn (counts requests, not
    tokens: a flow of long prompts gets as many turns as one of short prompts)."""

    type_name = "round-robin-fairness-policy"
    Params = _NoParams

    def __init__(self, params: _NoParams | None = None) -> None:
        self._last = ""

    def pick(self, heads, served, weight) -> str:
        flows = sorted(heads)
        for f in flows:
            if f > self._last:
                self._last = f
                return f
        self._last = flows[0]
        return flows[0]


class WeightedTokenFairness:
    """`weighted-token-fairness-policy` (extproc): the flow with the fewest tokens served per
    unit of weight goes next, tokens being uncached prompt + expected output. Served tokens
    decay (flowControl `usageHalfLife`), so a tenant idle for a while gets no unbounded
    catch-up burst; with shared state they are summed over every replica, so shares hold
    fleet-wide. Weights come from `flow_control.fairness_weights` (default 1 each). When the
    band's queue is full, a request of a flow under its share of the queue (queued tokens per
    weight) displaces the newest queued request of the flow holding the most, never a flow's
    last one (so a bounded queue cannot starve a tenant; FlowController._over_share)."""

    type_name = "weighted-token-fairness-policy"
    Params = _NoParams
    # When the band is full, a newcomer under its share of the queue displaces queued work
    # of the flow holding the most, instead of being shed itself.
    displaces = True
    # Its pick depends on usage only, which replicas share: a replica can tell when the next
    # flow fleet-wide is queued elsewhere (FlowController._defer_to_peer).
    fleet_wide = True

    def __init__(self, params: _NoParams | None = None) -> None:
        pass

    def pick(self, heads, served, weight) -> str:
        return min(heads, key=lambda f: (served.get(f, 0.0) / weight.get(f, 1.0), heads[f]))


ORDERING: tuple[type[Any], ...] = (FCFSOrdering, EDFOrdering, SLODeadlineOrdering)
FAIRNESS: tuple[type[Any], ...] = (GlobalStrictFairness, RoundRobinFairness, WeightedTokenFairness)


class UsageLimitPolicy(Protocol):
    def ceiling(self, priority: int, priorities: Sequence[int], saturation: float = 0.0) -> float:
        """The saturation above which a band's work is held (`priorities`: the bands known,
        this one included; `saturation`: the pool's now). Called once per dispatch
        opportunity of the band."""
        ...


class StaticUsageLimit:
    """`static-usage-limit-policy` (llm-d's default): one ceiling for every band."""

    type_name = "static-usage-limit-policy"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        threshold: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()

    def ceiling(self, priority: int, priorities: Sequence[int], saturation: float = 0.0) -> float:
        return self.params.threshold


class PriorityHoldback:
    """`priority-holdback-policy`: per-band ceilings from `maxCeiling` (highest band) down to
    `minCeiling` (lowest), linear by rank (`domain: rank`) or by priority value
    (`domain: value`), so lower bands stop first as the pool fills and the rest of the
    capacity stays for higher bands."""

    type_name = "priority-holdback-policy"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        minCeiling: Annotated[float, msgspec.Meta(ge=0, lt=1)]
        maxCeiling: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
        shape: Literal["linear"] = "linear"
        domain: Literal["rank", "value"] = "rank"

        def __post_init__(self) -> None:
            if self.maxCeiling <= self.minCeiling:
                raise ValueError("maxCeiling must be greater than minCeiling")

    def __init__(self, params: Params) -> None:
        self.params = params

    def ceiling(self, priority: int, priorities: Sequence[int], saturation: float = 0.0) -> float:
        lo, hi = self.params.minCeiling, self.params.maxCeiling
        ordered = sorted(set(priorities) | {priority}, reverse=True)
        if len(ordered) == 1:
            return hi
        if self.params.domain == "rank":
            i = ordered.index(priority)
            return hi - i * (hi - lo) / (len(ordered) - 1)
        pmax, pmin = ordered[0], ordered[-1]
        return lo + (priority - pmin) / (pmax - pmin) * (hi - lo)


class SoftReflectiveCeiling:
    """`soft-reflective-ceiling-policy`: no parameters. The band of rank i (0 = highest of
    the N known) has the reflective ceiling 1 - i * saturation / (N - 1): the top band is
    never gated below saturation 1.0, lower bands are gated first as saturation rises. A band
    at or past its reflective ceiling (saturation < 1.0) is not shut but throttled: it is
    open on one dispatch opportunity out of round(saturation / (1 - saturation)), so its
    dispatch rate falls continuously with saturation. One counter for the whole policy, so
    on any opportunity either every throttled band is open or every one is shut (dispatch
    stops at the first gated band, so per-band phases could starve a lower band)."""

    type_name = "soft-reflective-ceiling-policy"
    Params = _NoParams

    def __init__(self, params: _NoParams | None = None) -> None:
        self._tick = 0

    def ceiling(self, priority: int, priorities: Sequence[int], saturation: float = 0.0) -> float:
        ordered = sorted(set(priorities) | {priority}, reverse=True)
        n, rank = len(ordered), ordered.index(priority)
        if n == 1 or rank == 0:
            return 1.0
        open_now = False
        # Every band is at or past its reflective ceiling iff the lowest one is (1 - s <= s).
        if 1.0 - saturation <= saturation < 1.0:
            # Rounded half up (Go's math.Round); the small term keeps the period finite as
            # saturation approaches 1.0.
            period = max(1, math.floor(saturation / (1.0 - saturation + 1e-9) + 0.5))
            self._tick += 1
            open_now = self._tick % period == 0
        if saturation < 1.0 - rank * saturation / (n - 1):
            return 1.0
        if saturation >= 1.0:
            return 0.0
        return 1.0 if open_now else 0.0


USAGE_LIMITS: tuple[type[Any], ...] = (StaticUsageLimit, PriorityHoldback, SoftReflectiveCeiling)
