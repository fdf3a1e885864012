"""Context-length-aware routing: endpoints labelled with the prompt-length range they are
tuned for (`llm-d.ai/context-length-range: 0-4096`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import msgspec

from extproc.core import Candidate, InferenceRequest

# Out-of-range endpoints score strictly below this, so they never beat an in-range one.
_FALLBACK_CEILING = 0.3


def parse_range(text: str) -> tuple[int, int] | None:
    """'min-max' -> (min, max); None when malformed."""
    low, sep, high = text.partition("-")
    if not sep:
        return None
    try:
        return int(low.strip()), int(high.strip())
    except ValueError:
        return None


def range_score(length: int, low: int, high: int) -> float:
    """In range: above the fallback ceiling, higher for narrower ranges and more headroom.
    Out of range: below it, decaying with distance to the nearest bound (llm-d's formula)."""
    if low <= length <= high:
        width = high - low
        if width == 0:
            return 1.0
        width_score = 1.0 / (1.0 + width / 10000.0)
        headroom = (high - length) / width
        raw = 0.7 * width_score + 0.3 * headroom
        return _FALLBACK_CEILING + raw * (1.0 - _FALLBACK_CEILING)
    distance = length - high if length > high else low - length
    return _FALLBACK_CEILING / (1.0 + distance / 1000.0)


class ContextLengthAware:
    """Scores endpoints by how well the request's prompt length (estimated tokens) fits the
    range in their `label` (default `llm-d.ai/context-length-range`, value `min-max`):
    unlabelled endpoints 0.5, malformed ranges 0.0. With `enableFiltering` it is also a
    filter: endpoints whose range excludes the prompt are removed (unlabelled ones stay).
    Listed once in a profile, it acts as both.

    ```yaml
    - type: context-length-aware
      parameters: {label: llm-d.ai/context-length-range, enableFiltering: false}
    ```
    """

    type_name: ClassVar[str] = "context-length-aware"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        label: str = "llm-d.ai/context-length-range"
        enable_filtering: bool = False

        def __post_init__(self) -> None:
            if not self.label:
                raise ValueError("label must be specified")

    def __init__(self, params: Params | None = None) -> None:
        p = params or self.Params()
        self._label = p.label
        self._filtering = p.enable_filtering

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        if not self._filtering:
            return cands
        length = req.prompt_tokens
        kept = []
        for c in cands:
            text = c.endpoint.labels.get(self._label)
            if text is None:
                kept.append(c)
                continue
            bounds = parse_range(text)
            if bounds is not None and bounds[0] <= length <= bounds[1]:
                kept.append(c)
        return kept

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        length = req.prompt_tokens
        out = []
        for c in cands:
            text = c.endpoint.labels.get(self._label)
            if text is None:
                out.append(0.5)
                continue
            bounds = parse_range(text)
            out.append(0.0 if bounds is None else range_score(length, *bounds))
        return out
