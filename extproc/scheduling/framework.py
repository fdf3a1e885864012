"""The scheduling seam: plugin protocols, the profile runner and the scheduler.

A profile runs filters (each may only remove candidates), then weighted scorers (each gives
every candidate a score in [0, 1]), then one picker that orders the survivors by the weighted
sum; the first is the pick, the next ones are fallbacks. A profile handler decides which
profiles run for a request and assembles the `Decision` (one profile for plain serving;
decode, prefill and encode profiles for disaggregated serving).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from extproc.core import Candidate, Decision, Endpoint, InferenceRequest
from extproc.scheduling.conformance import PluginFaults, score_problem


@runtime_checkable
class Filter(Protocol):
    """Keeps the candidates a request may go to; returns a subset, order preserved."""

    @property
    def type_name(self) -> str:
        """The registered name; a class attribute on plugins, copied per instance by wrappers
        such as scheduling.timing's (hence a read-only property here, not a ClassVar)."""
        ...

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]: ...


@runtime_checkable
class Scorer(Protocol):
    """One score per candidate, same order, in [0, 1]; higher is better."""

    @property
    def type_name(self) -> str: ...

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[float]: ...


@runtime_checkable
class ExplainsTerms(Protocol):
    """A scorer that can say what its scores are made of: for each candidate, named input
    figures and intermediate terms (seconds, tokens, fractions). Asked only when a decision
    is explained (`x-extproc-explain`), after `score` on the same candidates, so a trace can
    tell which input tipped a decision without a patched copy of the picker."""

    def explain(
        self, req: InferenceRequest, cands: Sequence[Candidate]
    ) -> Sequence[Mapping[str, float]]: ...


@runtime_checkable
class Picker(Protocol):
    """Orders candidates by preference given their total scores; returns at most `limit`."""

    @property
    def type_name(self) -> str: ...

    def pick(
        self, cands: Sequence[Candidate], totals: Sequence[float], limit: int
    ) -> Sequence[Candidate]: ...


@runtime_checkable
class Observer(Protocol):
    """A plugin that learns from decisions (LRU of cold picks, media sent where, ...).
    Called once per decision that was sent to the proxy, after scheduling."""

    def observe(
        self, req: InferenceRequest, cands: Sequence[Candidate], decision: Decision
    ) -> None: ...


@runtime_checkable
class ResponseObserver(Protocol):
    """A plugin that learns from response timing: called when the model server's response
    headers pass through the proxy, `elapsed_s` after the decision."""

    def responded(self, req: InferenceRequest, decision: Decision, elapsed_s: float) -> None: ...


@runtime_checkable
class ResponseHeaders(Protocol):
    """A plugin that sends headers back to the client (e.g. a session token)."""

    def response_headers(self, decision: Decision) -> Mapping[str, str]: ...


@runtime_checkable
class Admitter(Protocol):
    """A plugin that may refuse a request before any profile runs (e.g. shed by latency
    SLO): returns to admit, raises `errors.Overloaded` (429) to shed. Admitters are declared
    in `plugins` only; every declared one runs, in declaration order."""

    def admit(self, req: InferenceRequest, cands: Sequence[Candidate]) -> None: ...


@runtime_checkable
class Binds(Protocol):
    """A plugin that reads another plugin's output (a latency consumer reads the producer):
    `bind` gets every built plugin by name once, before the first request, and raises
    `ConfigError` when what it needs is missing."""

    def bind(self, plugins: Mapping[str, object]) -> None: ...


@runtime_checkable
class EstimateUnits(Protocol):
    """A plugin that keeps figures in estimated tokens: told when every estimate becomes
    `factor` times what it was for the same prompt (approximate mode recalibrated its bytes
    per token), so figures learned before are not mixed with those after."""

    def units_changed(self, factor: float) -> None: ...


@runtime_checkable
class EndpointReset(Protocol):
    """A plugin that keeps figures per endpoint about its cache or queue: told when an
    endpoint's cache is gone (a restart, or it left the pool), so what it learned of the old
    process does not steer requests to the new one."""

    def endpoint_reset(self, address: str) -> None: ...


@runtime_checkable
class CacheCleared(Protocol):
    """A plugin that keeps figures per endpoint about what its cache holds: told when the
    engine emptied its prefix cache (a KV-event AllBlocksCleared, after POST
    /reset_prefix_cache) while it kept running, so what was written there before no longer
    counts. Its queue and running requests are still there: not an `EndpointReset`."""

    def cache_cleared(self, address: str) -> None: ...


@dataclass(frozen=True, slots=True)
class ProfileResult:
    """What one profile chose: candidates in preference order (may be empty)."""

    profile: str
    chosen: tuple[Candidate, ...]
    scores: Mapping[str, Mapping[str, float]]
    reasons: tuple[str, ...]
    # Per explaining scorer (`ExplainsTerms`), per address, its named terms; explained
    # decisions only.
    terms: Mapping[str, Mapping[str, Mapping[str, float]]] = field(default_factory=dict)


class ProfileRunner(Protocol):
    """Runs the named profile over the request's candidates (handlers call this); `limit`
    overrides how many candidates the picker returns (default: pick + fallbacks); `peer` is
    the endpoint an earlier stage chose (seen by plugins as `req.peer`)."""

    def __call__(
        self, name: str, limit: int | None = None, peer: Endpoint | None = None
    ) -> ProfileResult: ...


@runtime_checkable
class Decider(Protocol):
    """Decides whether a request gets a disaggregated stage (prefill or encode), given the
    endpoint the decode profile chose."""

    @property
    def type_name(self) -> str: ...

    def disaggregate(self, req: InferenceRequest, decode: Candidate | None) -> bool: ...


@runtime_checkable
class ProfileHandler(Protocol):
    """Chooses which profiles run and turns their results into one Decision."""

    @property
    def type_name(self) -> str: ...

    def handle(
        self,
        req: InferenceRequest,
        cands: Sequence[Candidate],
        profiles: Sequence[str],
        run: ProfileRunner,
    ) -> Decision: ...


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    name: str
    scorer: Scorer
    weight: float


@dataclass(frozen=True, slots=True)
class NamedFilter:
    name: str
    plugin: Filter


@dataclass(frozen=True, slots=True)
class Profile:
    """One scheduling profile: the plugins run for a request, in order. `faults` counts
    scores refused from misbehaving scorers (see scheduling/conformance.py)."""

    name: str
    filters: tuple[NamedFilter, ...]
    scorers: tuple[WeightedScorer, ...]
    picker: Picker
    faults: PluginFaults = field(default_factory=PluginFaults, compare=False)

    def run(
        self, req: InferenceRequest, cands: Sequence[Candidate], *, limit: int, explain: bool
    ) -> ProfileResult:
        reasons: list[str] = []
        for f in self.filters:
            before = cands
            cands = f.plugin.filter(req, cands)
            if explain and len(cands) != len(before):
                kept = {id(c) for c in cands}
                removed = [c.endpoint.address for c in before if id(c) not in kept]
                reasons.append(f"{self.name}/{f.name} removed {', '.join(removed)}")
            if not cands:
                return ProfileResult(self.name, (), {}, tuple(reasons))
        totals = [0.0] * len(cands)
        per_plugin: dict[str, dict[str, float]] = {}
        terms: dict[str, dict[str, dict[str, float]]] = {}
        for ws in self.scorers:
            try:
                scores = ws.scorer.score(req, cands)
                problem = score_problem(scores, len(cands))
            except Exception as exc:
                # A plugin's bug costs its say in this decision, not the request.
                problem = f"raised {type(exc).__name__}: {exc}"
            if problem is not None:
                self.faults.record(f"{self.name}/{ws.name}", problem)
                if explain:
                    reasons.append(f"{self.name}/{ws.name} ignored: {problem}")
                continue
            w = ws.weight
            totals = [t + w * s for t, s in zip(totals, scores, strict=True)]
            if explain:
                per_plugin[f"{self.name}/{ws.name}"] = {
                    c.endpoint.address: round(s, 4) for c, s in zip(cands, scores, strict=True)
                }
                if isinstance(ws.scorer, ExplainsTerms) and (
                    explained := _terms(ws.scorer, req, cands)
                ):
                    terms[f"{self.name}/{ws.name}"] = explained
        chosen = tuple(self.picker.pick(cands, totals, limit))
        if explain:
            per_plugin[f"{self.name}/total"] = {
                c.endpoint.address: round(t, 4) for c, t in zip(cands, totals, strict=True)
            }
        return ProfileResult(self.name, chosen, per_plugin, tuple(reasons), terms)


def _terms(
    scorer: ExplainsTerms, req: InferenceRequest, cands: Sequence[Candidate]
) -> dict[str, dict[str, float]]:
    """A scorer's explained terms by address. A failing explanation is reported under
    "error" with the exception's name: it only explains, the decision stands."""
    try:
        per = scorer.explain(req, cands)
        out = {
            c.endpoint.address: {k: round(float(v), 6) for k, v in t.items()}
            for c, t in zip(cands, per, strict=True)
        }
        # A wrapper around a scorer that explains nothing gives empty terms: none shown.
        return out if any(out.values()) else {}
    except Exception as exc:
        return {"error": {type(exc).__name__: 1.0}}


class Scheduler:
    """Runs the profile handler over the configured profiles for each request.

    `fallbacks` extra endpoints follow the pick in the primary profile's answer.
    """

    def __init__(
        self,
        handler: ProfileHandler,
        profiles: Sequence[Profile],
        *,
        fallbacks: int = 0,
        observers: Sequence[Observer] = (),
        responders: Sequence[ResponseHeaders] = (),
        admitters: Sequence[Admitter] = (),
        plugins: Sequence[object] = (),
    ) -> None:
        """`plugins` is every plugin instance built from the config, profiles or not (the
        app looks among them for ones that run loops, like the latency producer)."""
        if not profiles:
            raise ValueError("at least one profile is required")
        self._handler = handler
        self._profiles = {p.name: p for p in profiles}
        self._names = tuple(p.name for p in profiles)
        self._limit = 1 + fallbacks
        self._observers = tuple(observers)
        self._responders = tuple(responders)
        self._admitters = tuple(admitters)
        self.plugins: tuple[object, ...] = tuple(plugins)
        self._response_observers = tuple(p for p in self.plugins if isinstance(p, ResponseObserver))

    @property
    def profiles(self) -> Mapping[str, Profile]:
        return self._profiles

    def schedule(
        self, req: InferenceRequest, cands: Sequence[Candidate], *, explain: bool = False
    ) -> Decision:
        """An empty `Decision.endpoints` means nothing was eligible; the caller decides what
        that means (503, shed, ...). An admitter may raise `Overloaded` first."""

        for admitter in self._admitters:
            admitter.admit(req, cands)

        def run(name: str, limit: int | None = None, peer: Endpoint | None = None) -> ProfileResult:
            seen = req if peer is None else dataclasses.replace(req, peer=peer)
            n = limit or self._limit
            return self._profiles[name].run(seen, cands, limit=n, explain=explain)

        decision = self._handler.handle(req, cands, self._names, run)
        if self._responders and decision.endpoints:
            extra: dict[str, str] = dict(decision.response_headers)
            for r in self._responders:
                extra.update(r.response_headers(decision))
            decision = dataclasses.replace(decision, response_headers=extra)
        return decision

    def wrapped(
        self,
        profile: Callable[[Profile], Profile],
        handler: Callable[[ProfileHandler], ProfileHandler],
    ) -> Scheduler:
        """A copy whose profiles and profile handler went through the given wrappers: timing
        (scheduling/timing.py) wraps plugins this way, so neither the runner loop nor the
        plugins carry it."""
        return Scheduler(
            handler(self._handler),
            [profile(p) for p in self._profiles.values()],
            fallbacks=self._limit - 1,
            observers=self._observers,
            responders=self._responders,
            admitters=self._admitters,
            plugins=self.plugins,
        )

    def observe(
        self, req: InferenceRequest, cands: Sequence[Candidate], decision: Decision
    ) -> None:
        """Tell learning plugins where a request was sent."""
        for obs in self._observers:
            obs.observe(req, cands, decision)

    @property
    def learns_from_responses(self) -> bool:
        """Whether any plugin learns from response timing (`responded` does something)."""
        return bool(self._response_observers)

    def responded(self, req: InferenceRequest, decision: Decision, elapsed_s: float) -> None:
        """Tell plugins that learn from response timing when the response headers came."""
        for obs in self._response_observers:
            obs.responded(req, decision, elapsed_s)
