"""Topology affinity: place a request's prefill stage near the endpoint its decode stage
chose (same host, rack, zone or region, read from endpoint labels)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Literal

import msgspec

from extproc.core import Candidate, Endpoint, InferenceRequest

LEVELS = ("host", "rack", "zone", "region")
# Score per closest shared level; nothing shared scores 0 (llm-d's values).
LEVEL_SCORES = {"host": 1.0, "rack": 0.2, "zone": 0.05, "region": 0.02}
DEFAULT_LABELS: dict[str, str] = {
    "host": "kubernetes.io/hostname",
    "rack": "topology.kubernetes.io/rack",
    "zone": "topology.kubernetes.io/zone",
    "region": "topology.kubernetes.io/region",
}


def closest_level(peer: Endpoint, other: Endpoint, labels: Mapping[str, str]) -> int:
    """Index in LEVELS of the closest level both share (len(LEVELS): none)."""
    for i, level in enumerate(LEVELS):
        a = peer.labels.get(labels[level], "")
        if a and a == other.labels.get(labels[level], ""):
            return i
    return len(LEVELS)


class _TopologyParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
    topology_producer_name: str | None = None
    # extproc: the label key per level, set from a topology-extractor's parameters.
    level_labels: dict[str, str] = msgspec.field(default_factory=lambda: dict(DEFAULT_LABELS))

    def labels(self) -> dict[str, str]:
        return {**DEFAULT_LABELS, **self.level_labels}


class TopologyAffinityFilter:
    """When the request has a peer (the decode pick, while prefill is chosen), keeps the
    endpoints sharing at least `minAffinity` with it (`host` default, `rack`, `zone`,
    `region`); endpoints without topology labels are dropped; when none is close enough, all
    are kept. Without a peer, everything passes.

    ```yaml
    - type: topology-affinity-filter
      parameters: {minAffinity: rack}
    ```
    """

    type_name: ClassVar[str] = "topology-affinity-filter"

    class Params(_TopologyParams, frozen=True):
        min_affinity: Literal["host", "rack", "zone", "region"] = "host"

    def __init__(self, params: Params | None = None) -> None:
        p = params or self.Params()
        self._max_level = LEVELS.index(p.min_affinity)
        self._labels = p.labels()

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        peer = req.peer
        if peer is None:
            return cands
        kept = [
            c for c in cands if closest_level(peer, c.endpoint, self._labels) <= self._max_level
        ]
        return kept or cands


class TopologyAffinityScorer:
    """Scores closeness to the request's peer: same host 1.0, rack 0.2, zone 0.05, region
    0.02, nothing shared (or no peer) 0.

    ```yaml
    - type: topology-affinity-scorer
    ```
    """

    type_name: ClassVar[str] = "topology-affinity-scorer"

    Params = _TopologyParams

    def __init__(self, params: _TopologyParams | None = None) -> None:
        self._labels = (params or _TopologyParams()).labels()

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        peer = req.peer
        if peer is None:
            return [0.0] * len(cands)
        scores = []
        for c in cands:
            i = closest_level(peer, c.endpoint, self._labels)
            scores.append(LEVEL_SCORES[LEVELS[i]] if i < len(LEVELS) else 0.0)
        return scores
