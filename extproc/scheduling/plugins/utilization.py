"""llm-d's load gates and spreaders beyond the queue and KV scorers: a utilization filter
with per-metric ceilings, and a min-max scorer on running requests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, ClassVar, Literal

import msgspec

from extproc.core import Candidate, InferenceRequest

Metric = Literal["active-requests", "running-requests", "waiting-queue", "kv-cache-utilization"]


class Condition(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
    metric: Metric
    max_value: Annotated[float, msgspec.Meta(ge=0)]

    def __post_init__(self) -> None:
        if self.metric == "kv-cache-utilization" and self.max_value > 1:
            raise ValueError("maxValue of kv-cache-utilization is a fraction, at most 1")


def _value(c: Candidate, metric: Metric) -> float:
    s = c.state
    if metric == "active-requests":
        return float(s.inflight_requests)
    if metric == "running-requests":
        return float(s.running)
    if metric == "waiting-queue":
        return float(s.waiting)
    return s.kv_usage


class UtilizationFilter:
    """Keeps endpoints under every ceiling in `conditions` (metric: `active-requests` = the
    picker's in-flight count, `running-requests`, `waiting-queue`, `kv-cache-utilization`
    0..1). When none passes, `fallbackOnEmpty` keeps them all (default: none kept, so the
    request gets 503).

    ```yaml
    - type: utilization-filter
      parameters:
        conditions:
        - {metric: waiting-queue, maxValue: 32}
        - {metric: kv-cache-utilization, maxValue: 0.9}
        fallbackOnEmpty: true
    ```
    """

    type_name: ClassVar[str] = "utilization-filter"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        conditions: list[Condition]
        fallback_on_empty: bool = False
        in_flight_load_producer_name: str | None = None

        def __post_init__(self) -> None:
            if not self.conditions:
                raise ValueError("at least one condition is required")

    def __init__(self, params: Params) -> None:
        self._conds = tuple((c.metric, c.max_value) for c in params.conditions)
        self._fallback = params.fallback_on_empty

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        conds = self._conds
        kept = [c for c in cands if all(_value(c, m) <= top for m, top in conds)]
        if not kept and self._fallback:
            return cands
        return kept


class RunningRequestsSizeScorer:
    """Prefers endpoints running fewer requests, min-max scaled over the candidates: fewest
    1.0, most 0.0, all equal 1.0 (scraped `num_requests_running`).

    ```yaml
    - type: running-requests-size-scorer
    ```
    """

    type_name: ClassVar[str] = "running-requests-size-scorer"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        pass

    def __init__(self, params: Params | None = None) -> None:
        pass

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        running = [c.state.running for c in cands]
        if not running:
            return []
        low, high = min(running), max(running)
        if high == low:
            return [1.0] * len(cands)
        return [(high - r) / (high - low) for r in running]
