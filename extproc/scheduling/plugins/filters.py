"""Filters by endpoint labels: disaggregation roles (`llm-d.ai/role`) and label selectors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

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


class LabelSelectorFilter:
    """Keeps endpoints whose labels include every `matchLabels` pair.

    ```yaml
    - type: label-selector-filter
      parameters: {matchLabels: {hardware: h100}}
    ```
    """

    type_name: ClassVar[str] = "label-selector-filter"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        match_labels: dict[str, str] = msgspec.field(default_factory=dict)

    def __init__(self, params: Params | None = None) -> None:
        self._match = tuple((params or self.Params()).match_labels.items())

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        match = self._match
        return [c for c in cands if all(c.endpoint.labels.get(k) == v for k, v in match)]
