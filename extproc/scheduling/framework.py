"""The scheduling seam: plugin protocols and the profile runner.

A profile runs filters (each may only remove candidates), then weighted scorers (each gives
every candidate a score in [0, 1]), then one picker that orders the survivors by the weighted
sum. The first endpoint of the result is the pick; the next ones are fallbacks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

from extproc.core import Candidate, Decision, InferenceRequest


@runtime_checkable
class Filter(Protocol):
    """Keeps the candidates a request may go to; returns a subset, order preserved."""

    type_name: ClassVar[str]

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]: ...


@runtime_checkable
class Scorer(Protocol):
    """One score per candidate, same order, in [0, 1]; higher is better."""

    type_name: ClassVar[str]

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[float]: ...


@runtime_checkable
class Picker(Protocol):
    """Orders candidates by preference given their total scores; returns at most `limit`."""

    type_name: ClassVar[str]

    def pick(
        self, cands: Sequence[Candidate], totals: Sequence[float], limit: int
    ) -> Sequence[Candidate]: ...


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    name: str
    scorer: Scorer
    weight: float


@dataclass(frozen=True, slots=True)
class NamedFilter:
    name: str
    filter: Filter


@dataclass(frozen=True, slots=True)
class Profile:
    """One scheduling profile: the plugins run for a request, in order."""

    name: str
    filters: tuple[NamedFilter, ...]
    scorers: tuple[WeightedScorer, ...]
    picker: Picker

    def run(
        self, req: InferenceRequest, cands: Sequence[Candidate], *, limit: int, explain: bool
    ) -> Decision:
        """Schedule `req` over `cands`. An empty `Decision.endpoints` means nothing was
        eligible; the caller decides what that means (503, shed, ...)."""
        reasons: list[str] = []
        for f in self.filters:
            before = len(cands)
            cands = f.filter(req, cands)
            if explain and len(cands) != before:
                reasons.append(f"{f.name}: kept {len(cands)} of {before}")
            if not cands:
                return Decision(endpoints=(), reasons=tuple(reasons), profile=self.name)
        totals = [0.0] * len(cands)
        per_plugin: dict[str, dict[str, float]] = {}
        for ws in self.scorers:
            scores = ws.scorer.score(req, cands)
            for i, s in enumerate(scores):
                totals[i] += ws.weight * s
            if explain:
                per_plugin[ws.name] = {
                    c.endpoint.address: round(s, 4) for c, s in zip(cands, scores, strict=True)
                }
        chosen = self.picker.pick(cands, totals, limit)
        if explain:
            per_plugin["total"] = {
                c.endpoint.address: round(t, 4) for c, t in zip(cands, totals, strict=True)
            }
        return Decision(
            endpoints=tuple(c.endpoint for c in chosen),
            scores=per_plugin,
            reasons=tuple(reasons),
            profile=self.name,
        )


class Scheduler:
    """Runs the profile for each request. One profile for now; the profile handler that
    chooses among several (disaggregation, encode tier) plugs in here."""

    def __init__(self, profile: Profile, *, fallbacks: int = 0) -> None:
        self._profile = profile
        self._limit = 1 + fallbacks

    @property
    def profile(self) -> Profile:
        return self._profile

    def schedule(
        self, req: InferenceRequest, cands: Sequence[Candidate], *, explain: bool = False
    ) -> Decision:
        return self._profile.run(req, cands, limit=self._limit, explain=explain)
