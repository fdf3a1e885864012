"""Filters by endpoint labels: disaggregation roles (`llm-d.ai/role`) and label selectors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Literal

import msgspec

from extproc.core import Candidate, InferenceRequest


class _NoParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class _RoleFilter:
    roles: ClassVar[frozenset[str]]
    Params = _NoParams

    def __init__(self, params: _NoParams | None = None) -> None:
        pass

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        roles = self.roles
        return [c for c in cands if c.endpoint.role in roles]


class DecodeFilter(_RoleFilter):
    """Keeps endpoints that decode: roles decode, prefill-decode, encode-prefill-decode,
    both, and unlabeled endpoints.

    ```yaml
    - type: decode-filter
    ```
    """

    type_name: ClassVar[str] = "decode-filter"
    roles = frozenset({"", "decode", "prefill-decode", "encode-prefill-decode", "both"})


class PrefillFilter(_RoleFilter):
    """Keeps endpoints that prefill: roles prefill, prefill-decode, encode-prefill,
    encode-prefill-decode, both.

    ```yaml
    - type: prefill-filter
    ```
    """

    type_name: ClassVar[str] = "prefill-filter"
    roles = frozenset(
        {"prefill", "prefill-decode", "encode-prefill", "encode-prefill-decode", "both"}
    )


class EncodeFilter(_RoleFilter):
    """Keeps endpoints that encode media: roles encode, encode-prefill, encode-prefill-decode.

    ```yaml
    - type: encode-filter
    ```
    """

    type_name: ClassVar[str] = "encode-filter"
    roles = frozenset({"encode", "encode-prefill", "encode-prefill-decode"})


class LabelRequirement(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One Kubernetes `matchExpressions` entry."""

    key: str
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.operator in ("In", "NotIn") and not self.values:
            raise ValueError(f"operator {self.operator} needs values")
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise ValueError(f"operator {self.operator} takes no values")

    def matches(self, labels: Mapping[str, str]) -> bool:
        op = self.operator
        if op == "Exists":
            return self.key in labels
        if op == "DoesNotExist":
            return self.key not in labels
        if op == "In":
            return labels.get(self.key) in self.values
        return labels.get(self.key) not in self.values  # NotIn: absent labels match too


class LabelSelectorFilter:
    """Keeps endpoints whose labels match a Kubernetes label selector: every `matchLabels`
    pair, and every `matchExpressions` requirement (In, NotIn, Exists, DoesNotExist).

    ```yaml
    - type: label-selector-filter
      parameters:
        matchLabels: {hardware: h100}
        matchExpressions: [{key: zone, operator: In, values: [a, b]}]
    ```
    """

    type_name: ClassVar[str] = "label-selector-filter"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        match_labels: dict[str, str] = msgspec.field(default_factory=dict)
        match_expressions: list[LabelRequirement] = msgspec.field(default_factory=list)

    def __init__(self, params: Params | None = None) -> None:
        p = params or self.Params()
        self._match = tuple(p.match_labels.items())
        self._exprs = tuple(p.match_expressions)

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        match, exprs = self._match, self._exprs
        return [
            c
            for c in cands
            if all(c.endpoint.labels.get(k) == v for k, v in match)
            and all(e.matches(c.endpoint.labels) for e in exprs)
        ]


class ByLabelSelectorFilter(LabelSelectorFilter):
    """llm-d's deprecated name of `label-selector-filter` (same parameters).

    ```yaml
    - type: by-label-selector
      parameters: {matchLabels: {hardware: h100}}
    ```
    """

    type_name: ClassVar[str] = "by-label-selector"


class ByLabelFilter:
    """Keeps endpoints whose `label` has one of `validValues`; with `allowsNoLabel`, also
    endpoints without the label. At least one of the two is required.

    ```yaml
    - type: by-label
      parameters: {label: llm-d.ai/role, validValues: [decode, both], allowsNoLabel: true}
    ```
    """

    type_name: ClassVar[str] = "by-label"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        label: str
        valid_values: list[str] = msgspec.field(default_factory=list)
        allows_no_label: bool = False

        def __post_init__(self) -> None:
            if not self.label:
                raise ValueError("label must be specified")
            if not self.valid_values and not self.allows_no_label:
                raise ValueError("validValues must be given unless allowsNoLabel is true")

    def __init__(self, params: Params) -> None:
        self._label = params.label
        self._valid = frozenset(params.valid_values)
        self._no_label = params.allows_no_label

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        label, valid, no_label = self._label, self._valid, self._no_label
        out = []
        for c in cands:
            value = c.endpoint.labels.get(label)
            if (value is None and no_label) or (value is not None and value in valid):
                out.append(c)
        return out
