"""Per-plugin and end-to-end scheduling time, for llm-d's `plugin_duration_seconds` and
`scheduler_e2e_duration_seconds` (and the scheduling-attempt counter).

`instrument(scheduler, sink)` returns a scheduler whose plugins sit behind thin timing proxies
and whose `schedule` is timed as a whole. The profile runner loop and the plugin bodies stay
as they are (STYLE.md §3): an uninstrumented scheduler pays nothing, an instrumented one pays
two clock reads and one histogram add per plugin call (bench/RESULTS.md has the figures).

Extension points follow llm-d's names: Filter, Scorer, Picker; the profile handler's own time
(choosing profiles and assembling the decision, the profiles' runs excluded) is reported as
ProfilePicker, since extproc's handler does llm-d's ProfilePicker and ProcessProfilesResults
steps in one call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from time import perf_counter
from typing import Protocol, cast

from extproc.core import Candidate, Decision, Endpoint, InferenceRequest
from extproc.scheduling.framework import (
    NamedFilter,
    Profile,
    ProfileHandler,
    ProfileResult,
    ProfileRunner,
    Scheduler,
    WeightedScorer,
)

Observe = Callable[[float], None]


class SchedulingSink(Protocol):
    """Where timings go (server/llmd_metrics.LlmdMetrics satisfies it)."""

    def plugin_timer(self, extension_point: str, plugin_type: str, plugin_name: str) -> Observe: ...

    def scheduler_timer(self) -> Observe: ...

    def scheduled(self, model: str, endpoint: Endpoint | None) -> None: ...


class _TimedFilter:
    __slots__ = ("_inner", "_observe", "type_name")

    def __init__(self, inner, observe: Observe) -> None:
        self._inner, self._observe, self.type_name = inner, observe, inner.type_name

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        t = perf_counter()
        out = self._inner.filter(req, cands)
        self._observe(perf_counter() - t)
        return out


class _TimedScorer:
    __slots__ = ("_inner", "_observe", "type_name")

    def __init__(self, inner, observe: Observe) -> None:
        self._inner, self._observe, self.type_name = inner, observe, inner.type_name

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[float]:
        t = perf_counter()
        out = self._inner.score(req, cands)
        self._observe(perf_counter() - t)
        return out

    def explain(
        self, req: InferenceRequest, cands: Sequence[Candidate]
    ) -> Sequence[Mapping[str, float]]:
        """The wrapped scorer's explanation (not timed: explained decisions only); none
        when it gives none."""
        inner = getattr(self._inner, "explain", None)
        return inner(req, cands) if inner is not None else [{} for _ in cands]


class _TimedPicker:
    __slots__ = ("_inner", "_observe", "type_name")

    def __init__(self, inner, observe: Observe) -> None:
        self._inner, self._observe, self.type_name = inner, observe, inner.type_name

    def pick(
        self, cands: Sequence[Candidate], totals: Sequence[float], limit: int
    ) -> Sequence[Candidate]:
        t = perf_counter()
        out = self._inner.pick(cands, totals, limit)
        self._observe(perf_counter() - t)
        return out


class _TimedHandler:
    __slots__ = ("_inner", "_observe", "type_name")

    def __init__(self, inner: ProfileHandler, observe: Observe) -> None:
        self._inner, self._observe, self.type_name = inner, observe, inner.type_name

    def handle(
        self,
        req: InferenceRequest,
        cands: Sequence[Candidate],
        profiles: Sequence[str],
        run: ProfileRunner,
    ) -> Decision:
        spent = 0.0

        def timed_run(name: str, *args, **kwargs) -> ProfileResult:
            # Passes the runner's arguments on as they are (limit, peer, ...).
            nonlocal spent
            t = perf_counter()
            result = run(name, *args, **kwargs)
            spent += perf_counter() - t
            return result

        t = perf_counter()
        decision = self._inner.handle(req, cands, profiles, timed_run)
        self._observe(perf_counter() - t - spent)
        return decision


def _timed_profile(profile: Profile, sink: SchedulingSink) -> Profile:
    return dataclasses.replace(
        profile,
        filters=tuple(
            NamedFilter(
                f.name,
                _TimedFilter(f.plugin, sink.plugin_timer("Filter", f.plugin.type_name, f.name)),
            )
            for f in profile.filters
        ),
        scorers=tuple(
            WeightedScorer(
                s.name,
                _TimedScorer(s.scorer, sink.plugin_timer("Scorer", s.scorer.type_name, s.name)),
                s.weight,
            )
            for s in profile.scorers
        ),
        picker=_TimedPicker(
            profile.picker,
            sink.plugin_timer("Picker", profile.picker.type_name, profile.picker.type_name),
        ),
    )


class TimedScheduler:
    """A Scheduler timed as a whole, over a copy whose plugins are timed one by one. An
    admitter's refusal (raised before scheduling) is neither timed nor counted as an attempt."""

    def __init__(self, scheduler: Scheduler, sink: SchedulingSink) -> None:
        self._inner = scheduler.wrapped(
            lambda p: _timed_profile(p, sink),
            lambda h: _TimedHandler(
                h, sink.plugin_timer("ProfilePicker", h.type_name, h.type_name)
            ),
        )
        self._observe = sink.scheduler_timer()
        self._scheduled = sink.scheduled

    def __getattr__(self, name: str):
        # Everything but `schedule` is the wrapped scheduler's (profiles, plugins, observe,
        # responded, ...), so the Scheduler's API stays whole as it grows.
        return getattr(self._inner, name)

    def schedule(
        self, req: InferenceRequest, cands: Sequence[Candidate], *, explain: bool = False
    ) -> Decision:
        t = perf_counter()
        decision = self._inner.schedule(req, cands, explain=explain)
        self._observe(perf_counter() - t)
        self._scheduled(req.model, decision.endpoints[0] if decision.endpoints else None)
        return decision


def instrument(scheduler: Scheduler, sink: SchedulingSink) -> Scheduler:
    # A TimedScheduler stands in for the Scheduler it wraps: `schedule` is its own, the rest
    # of the API is the wrapped one's through __getattr__, which the type system cannot see.
    return cast(Scheduler, TimedScheduler(scheduler, sink))
