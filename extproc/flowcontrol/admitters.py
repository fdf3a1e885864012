"""Admitters: a yes/no per request before it may queue (llm-d's admission extension point).

`probabilistic-admitter`: requests with priority >= 0 are always admitted; sheddable ones
(priority < 0) are refused with probability min(saturation^power * k, 1), saturation being
the roofline average over endpoints of max(waiting / queueDepthThreshold, KV use /
kvCacheUtilThreshold), an endpoint never scraped counting as 1.0. With the defaults (power
5, k 300) shedding starts around saturation 0.15 and is total from about 0.34. A refused
request gets 429 `rejected-saturated`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Protocol

import msgspec

from extproc.core import EndpointState

_Pos = Annotated[float, msgspec.Meta(gt=0)]


class Admitter(Protocol):
    def admit(
        self, priority: int, states: Sequence[EndpointState], rand: Callable[[], float]
    ) -> bool: ...


class ProbabilisticAdmitter:
    """`probabilistic-admitter`: sheds sheddable traffic (priority < 0) gradually as the
    pool fills; see the module docstring for the curve."""

    type_name = "probabilistic-admitter"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        queueDepthThreshold: Annotated[int, msgspec.Meta(gt=0)] = 5
        kvCacheUtilThreshold: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.8
        power: _Pos = 5.0
        k: _Pos = 300.0

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()

    def shed_probability(self, states: Sequence[EndpointState]) -> float:
        if not states:
            return 0.0  # nothing to measure: admit (llm-d's safe default)
        p = self.params
        total = 0.0
        for s in states:
            if s.age_s is None:
                total += 1.0
            else:
                total += max(s.waiting / p.queueDepthThreshold, s.kv_usage / p.kvCacheUtilThreshold)
        sat = total / len(states)
        return min(sat**p.power * p.k, 1.0)

    def admit(
        self, priority: int, states: Sequence[EndpointState], rand: Callable[[], float]
    ) -> bool:
        if priority >= 0:
            return True
        return rand() >= self.shed_probability(states)


ADMITTERS: tuple[type, ...] = (ProbabilisticAdmitter,)
