"""Pickers: turn total scores into an ordered choice (pick first, then fallbacks)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import ClassVar

import msgspec

from extproc.core import Candidate


class _NoParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
    # llm-d's picker parameter, accepted; how many endpoints a decision carries is the pick
    # plus `server.fallbacks` (check-config says so when it is set).
    max_num_of_endpoints: int | None = None


class _RandomizedPicker:
    """Pickers take no parameters; their randomness is injectable for tests."""

    Params = _NoParams

    def __init__(self, params: _NoParams | None = None, *, rng: random.Random | None = None):
        self._rng = rng or random.Random()


class MaxScorePicker(_RandomizedPicker):
    """Highest total score first. Ties are broken at random, so a burst of equal requests
    spreads over equally good endpoints instead of piling onto the first one listed.

    ```yaml
    - type: max-score-picker
    ```
    """

    type_name: ClassVar[str] = "max-score-picker"

    def pick(
        self, cands: Sequence[Candidate], totals: Sequence[float], limit: int
    ) -> list[Candidate]:
        if limit == 1:
            # The common case in one pass: the best score, a random one of its ties.
            best = max(totals)
            ties = [i for i, t in enumerate(totals) if t == best]
            return [cands[ties[0] if len(ties) == 1 else self._rng.choice(ties)]]
        rnd = self._rng.random
        order = sorted(range(len(cands)), key=lambda i: (-totals[i], rnd()))
        return [cands[i] for i in order[:limit]]


class RandomPicker(_RandomizedPicker):
    """Uniformly random order, ignoring scores (a baseline and a tie-breaker of last resort).

    ```yaml
    - type: random-picker
    ```
    """

    type_name: ClassVar[str] = "random-picker"

    def pick(
        self, cands: Sequence[Candidate], totals: Sequence[float], limit: int
    ) -> list[Candidate]:
        return self._rng.sample(list(cands), min(limit, len(cands)))


class WeightedRandomPicker(_RandomizedPicker):
    """Random order weighted by total score (an endpoint with twice the score is twice as
    likely to come first); spreads load while still following the scores. Zero scores are
    picked last.

    ```yaml
    - type: weighted-random-picker
    ```
    """

    type_name: ClassVar[str] = "weighted-random-picker"

    def pick(
        self, cands: Sequence[Candidate], totals: Sequence[float], limit: int
    ) -> list[Candidate]:
        # Efraimidis-Spirakis: sort by u ** (1 / w) descending gives a weighted sample
        # without replacement in one pass.
        rnd = self._rng.random

        def key(i: int) -> float:
            w = totals[i]
            return rnd() ** (1.0 / w) if w > 0 else -rnd()

        order = sorted(range(len(cands)), key=key, reverse=True)
        return [cands[i] for i in order[:limit]]
