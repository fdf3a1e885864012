"""`program-aware-fairness`: llm-d's fairness policy that treats each fairness ID as a
program (an agentic workflow, a tenant) and serves the program with the least attained
service, the age of each program's oldest queued request breaking ties.

Score per non-empty flow (highest goes next), LAS strategy:
`lasWeightService * (1 - norm(service)) + lasWeightHeadWait * norm(head wait)`, each signal
range-normalised over the flows competing now (0.5 for all when they are equal). Attained
service is weighted tokens (input 1, output 2), decayed with a wall-clock half-life
(`lasHalfLifeSeconds`, 0 = never), folded in lazily so an idle program ages out without
being visited. Programs inactive for `evictionTtlSeconds` are forgotten, checked every
`evictionSweepSeconds`.

Unlike llm-d, which adds a request's service at completion from the response's `usage`,
extproc charges it at dispatch from the request's estimate (uncached prompt tokens +
expected output tokens, the figures flow control already counts): the picker does not read
response bodies. A request cut by eviction gets its charge back (`refund`): its client got
no answer. Time comes from the controller's clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec

from extproc.flowcontrol.policies import Arrival

_NonNeg = Annotated[float, msgspec.Meta(ge=0)]

WEIGHT_INPUT_TOKEN = 1.0
WEIGHT_OUTPUT_TOKEN = 2.0  # output tokens cost about twice as much compute (llm-d's weighting)


@dataclass(slots=True)
class _Program:
    service: float = 0.0
    anchor: float = 0.0  # the instant up to which decay has been folded into `service`
    active: float = 0.0  # last dispatch (or first sight), for the idle sweep


def _cost(input_tokens: int, output_tokens: int) -> float:
    return WEIGHT_INPUT_TOKEN * input_tokens + WEIGHT_OUTPUT_TOKEN * output_tokens


def _norm(v: float, lo: float, hi: float) -> float:
    return 0.5 if hi == lo else (v - lo) / (hi - lo)


class ProgramAwareFairness:
    """`program-aware-fairness` (strategy `las`): least attained service first; see the
    module docstring. One instance per configured plugin, shared by the bands that name it,
    so a program's service counts across bands (as in llm-d)."""

    type_name = "program-aware-fairness"
    # The controller hands this policy the heads' arrivals and its clock (`pick_at`) and
    # tells it what each dispatch costs (`charge`) and what each cut gives back (`refund`).
    timed = True
    spans_bands = True

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        strategy: Literal["las"] = "las"
        evictionTtlSeconds: _NonNeg = 3600.0
        evictionSweepSeconds: Annotated[float, msgspec.Meta(gt=0)] = 300.0
        lasWeightService: _NonNeg = 0.8
        lasWeightHeadWait: _NonNeg = 0.2
        lasHalfLifeSeconds: _NonNeg = 60.0

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()
        self._programs: dict[str, _Program] = {}
        self._swept: float | None = None

    def service(self, program: str, now: float) -> float:
        """The program's attained service, decayed up to `now`."""
        prog = self._programs.get(program)
        if prog is None:
            return 0.0
        return self._decay(prog, now)

    def services(self, now: float) -> dict[str, float]:
        """Every tracked program's attained service at `now`, for the gauge: read only (the
        decay is computed, not folded in)."""
        return {f: p.service * self._weight(now - p.anchor) for f, p in self._programs.items()}

    def _weight(self, dt: float) -> float:
        """What a unit of service still weighs `dt` seconds on."""
        hl = self.params.lasHalfLifeSeconds
        return math.pow(2.0, -dt / hl) if dt > 0 and hl > 0 else 1.0

    def _decay(self, prog: _Program, now: float) -> float:
        if now > prog.anchor:
            prog.service *= self._weight(now - prog.anchor)
            prog.anchor = now
        return prog.service

    def _program(self, program: str, now: float) -> _Program:
        prog = self._programs.get(program)
        if prog is None:
            prog = self._programs[program] = _Program(anchor=now, active=now)
        return prog

    def pick(self, heads, served, weight) -> str:
        # Without arrival times (never called so by the controller): least service alone.
        return min(heads, key=lambda f: (self._programs.get(f, _Program()).service, heads[f]))

    def pick_at(self, heads: Mapping[str, Arrival], now: float) -> str:
        """One of `heads`' flows, given each flow's head arrival."""
        self._sweep(now)
        service = {f: self._decay(self._program(f, now), now) for f in heads}
        wait = {f: max(0.0, now - a.enqueued) for f, a in heads.items()}
        s_lo, s_hi = min(service.values()), max(service.values())
        w_lo, w_hi = min(wait.values()), max(wait.values())
        p = self.params

        def score(f: str) -> tuple[float, float]:
            s = p.lasWeightService * (1.0 - _norm(service[f], s_lo, s_hi))
            s += p.lasWeightHeadWait * _norm(wait[f], w_lo, w_hi)
            return (s, -heads[f].seq)  # equal scores: the older head

        return max(heads, key=score)

    def charge(self, program: str, input_tokens: int, output_tokens: int, now: float) -> None:
        """A request of `program` was dispatched: add its weighted token cost."""
        prog = self._program(program, now)
        self._decay(prog, now)
        prog.service += _cost(input_tokens, output_tokens)
        prog.active = now

    def refund(
        self, program: str, input_tokens: int, output_tokens: int, charged_at: float, now: float
    ) -> None:
        """A request of `program` charged at `charged_at` was cut by eviction: its client got
        no answer, so its cost comes back out of the program's service, as much of it as
        the decay since `charged_at` has left (else each cut would leave the program further
        behind, served nothing and charged as if it had been). Less than one token left is
        taken as none: decayed in one step here and in several in the service, a charge that
        was all the program had leaves a float residue. Not a dispatch: the program's last
        activity stays where it was."""
        prog = self._programs.get(program)
        if prog is None:
            return  # forgotten by the idle sweep: nothing of the charge is left
        left = self._decay(prog, now) - _cost(input_tokens, output_tokens) * self._weight(
            now - charged_at
        )
        prog.service = left if left >= 1.0 else 0.0

    def _sweep(self, now: float) -> None:
        p = self.params
        if self._swept is None:
            self._swept = now
        if not p.evictionTtlSeconds or now - self._swept < p.evictionSweepSeconds:
            return
        self._swept = now
        ttl = p.evictionTtlSeconds
        for f in [f for f, prog in self._programs.items() if now - prog.active > ttl]:
            del self._programs[f]

    def programs(self) -> int:
        """How many programs are tracked (bounded by the idle sweep)."""
        return len(self._programs)
