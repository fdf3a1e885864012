"""Queue policies: which flow of a band goes next (fairness), and which of a flow's requests
(ordering). llm-d's type names; `weighted-token-fairness-policy` is ours, the one that counts
tokens.

Ordering policies turn a queued item into a sort key (smallest first); fairness policies
choose among the band's non-empty flows, given each flow's head key and the tokens each flow
has been served (decayed, fleet-wide when shared through Redis).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Protocol

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
    fleet-wide. Weights come from flow-control `fairnessWeights` (default 1 each)."""

    type_name = "weighted-token-fairness-policy"
    Params = _NoParams

    def __init__(self, params: _NoParams | None = None) -> None:
        pass

    def pick(self, heads, served, weight) -> str:
        return min(heads, key=lambda f: (served.get(f, 0.0) / weight.get(f, 1.0), heads[f]))


ORDERING: tuple[type, ...] = (FCFSOrdering, EDFOrdering, SLODeadlineOrdering)
FAIRNESS: tuple[type, ...] = (GlobalStrictFairness, RoundRobinFairness, WeightedTokenFairness)
