"""Load scorers: prefer endpoints with less work placed on them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import msgspec

from extproc.core import Candidate, InferenceRequest


class ActiveRequestScorer:
    """Prefers endpoints with fewer in-flight requests placed by the pickers.

    Score is 1.0 for the least-loaded candidate(s), 0.0 for the most loaded, linear between
    (all 1.0 when loads are equal). In-flight counts are updated at the decision, so a burst
    spreads even before any model-server metrics move.

    ```yaml
    - type: active-request-scorer
    ```
    """

    type_name: ClassVar[str] = "active-request-scorer"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        pass

    def __init__(self, params: Params | None = None) -> None:
        pass

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        loads = [c.state.inflight_requests for c in cands]
        lo, hi = min(loads), max(loads)
        if hi == lo:
            return [1.0] * len(cands)
        span = hi - lo
        return [(hi - n) / span for n in loads]
