"""A third-party scheduling plugin, written as an outside author would: it imports only
`extproc.plugins` and is found through its `extproc.plugins` entry point."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec

from extproc.plugins import Candidate, InferenceRequest, PluginParams


class PreferPortScorer:
    """Prefers endpoints listening on `port` (1.0) over the others (0.0)."""

    type_name = "prefer-port-scorer"

    class Params(PluginParams):
        port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 8000

    def __init__(self, params: Params) -> None:
        self._suffix = f":{params.port}"

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        return [float(c.endpoint.address.endswith(self._suffix)) for c in cands]
