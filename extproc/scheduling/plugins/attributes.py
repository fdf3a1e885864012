"""llm-d's endpoint-attribute plugins: filter and score endpoints on a named attribute from
a data producer (in extproc: `GPUUtilization` from the DCGM exporter, see
endpoints/dcgm.py), read from `EndpointState.attributes`."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import ClassVar, Literal

import msgspec

from extproc.core import Candidate, InferenceRequest

_OPERATORS: dict[str, Callable[[float, float], bool]] = {
    "LessThan": operator.lt,
    "LessThanOrEqual": operator.le,
    "GreaterThan": operator.gt,
    "GreaterThanOrEqual": operator.ge,
    "Equal": operator.eq,
    "NotEqual": operator.ne,
}


class Threshold(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    operator: Literal[
        "LessThan", "LessThanOrEqual", "GreaterThan", "GreaterThanOrEqual", "Equal", "NotEqual"
    ]
    value: float


class FilterAlgorithm(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["threshold"]
    threshold: Threshold


class EndpointAttributeFilter:
    """Keeps endpoints whose `attribute` passes `algorithm.threshold` (operator and value).
    An endpoint without the attribute passes when `onMissing: Pass` (default) and is
    removed with `Fail`. When nothing passes, `fallbackOnEmpty` keeps them all.

    ```yaml
    - type: endpoint-attribute-filter
      parameters:
        attribute: GPUUtilization
        producer: dcgm-extractor
        algorithm: {type: threshold, threshold: {operator: LessThanOrEqual, value: 0.9}}
    ```
    """

    type_name: ClassVar[str] = "endpoint-attribute-filter"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        attribute: str
        algorithm: FilterAlgorithm
        producer: str | None = None
        on_missing: Literal["Pass", "Fail"] = "Pass"
        fallback_on_empty: bool = False

    def __init__(self, params: Params) -> None:
        self._key = params.attribute
        self._test = _OPERATORS[params.algorithm.threshold.operator]
        self._value = params.algorithm.threshold.value
        self._pass_missing = params.on_missing == "Pass"
        self._fallback = params.fallback_on_empty

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        kept = []
        for c in cands:
            v = c.state.attributes.get(self._key)
            if (v is None and self._pass_missing) or (v is not None and self._test(v, self._value)):
                kept.append(c)
        if not kept and self._fallback:
            return cands
        return kept


class FixedRange(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    min: float
    max: float

    def __post_init__(self) -> None:
        if self.min >= self.max:
            raise ValueError("fixedRange.min must be below fixedRange.max")


class AdaptiveRange(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class Normalization(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
    fixed_range: FixedRange | None = None
    adaptive_range: AdaptiveRange | None = None

    def __post_init__(self) -> None:
        if self.fixed_range is not None and self.adaptive_range is not None:
            raise ValueError("give at most one of fixedRange and adaptiveRange")


class ScorerAlgorithm(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["linear_lower_is_better", "linear_higher_is_better"]
    normalization: Normalization = Normalization()


class EndpointAttributeScorer:
    """Scores endpoints linearly on `attributeKey`: with `fixedRange` the value is placed
    in [min, max] (clamped), otherwise (adaptive) between the candidates' lowest and highest
    value (all equal: 1.0). `linear_lower_is_better` inverts it. Endpoints without the
    attribute score 0.

    ```yaml
    - type: endpoint-attribute-scorer
      parameters:
        attributeKey: GPUUtilization
        algorithm: {type: linear_lower_is_better, normalization: {fixedRange: {min: 0, max: 1}}}
    ```
    """

    type_name: ClassVar[str] = "endpoint-attribute-scorer"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        attribute_key: str
        algorithm: ScorerAlgorithm
        producer: str | None = None

    def __init__(self, params: Params) -> None:
        self._key = params.attribute_key
        self._lower = params.algorithm.type == "linear_lower_is_better"
        self._fixed = params.algorithm.normalization.fixed_range

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        values = [c.state.attributes.get(self._key) for c in cands]
        known = [v for v in values if v is not None]
        if not known:
            return [0.0] * len(cands)
        if self._fixed is not None:
            low, high = self._fixed.min, self._fixed.max
        else:
            low, high = min(known), max(known)
        out = []
        for v in values:
            if v is None:
                out.append(0.0)
            elif high == low:
                out.append(1.0)
            else:
                x = min(1.0, max(0.0, (v - low) / (high - low)))
                out.append(1.0 - x if self._lower else x)
        return out
