"""In-flight accounting: requests (and their estimated prompt tokens) placed on each endpoint
and not yet finished. Incremented at the decision, released when the ext_proc stream ends."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Placement:
    """What one decision added; handed back to `release` exactly once. `scale`: the
    counter's unit when it was added (`units_changed`), so a placement made before a change
    of unit gives back what it counts for now, not what it added."""

    address: str
    tokens: int
    scale: float = 1.0


class InFlightCounter(Protocol):
    """What the router needs from in-flight accounting: synchronous, never awaiting, so the
    hot path cannot stall on a shared store (`SharedInFlight` syncs in the background)."""

    def acquire(self, address: str, tokens: int) -> Placement: ...
    def release(self, placement: Placement) -> None: ...
    def requests(self, address: str) -> int: ...
    def tokens(self, address: str) -> int: ...
    def total(self) -> int: ...
    def units_changed(self, factor: float) -> None: ...


def given_back(placement: Placement, scale: float) -> int:
    """The tokens `placement` counts for in a counter now at unit `scale`."""
    if placement.scale == scale:
        return placement.tokens
    return round(placement.tokens * scale / placement.scale)


def rescaled(tokens: dict[str, int], factor: float) -> Counter[str]:
    """Per-endpoint token counts in a unit `factor` times the old one."""
    return Counter({a: round(t * factor) for a, t in tokens.items()})


class InFlight:
    """Process-local counts. Not thread-safe: used from the event loop only."""

    def __init__(self) -> None:
        self._requests: Counter[str] = Counter()
        self._tokens: Counter[str] = Counter()
        self._scale = 1.0  # every units change's factor, multiplied (`units_changed`)

    def acquire(self, address: str, tokens: int) -> Placement:
        self._requests[address] += 1
        self._tokens[address] += tokens
        return Placement(address, tokens, self._scale)

    def release(self, placement: Placement) -> None:
        a = placement.address
        self._requests[a] -= 1
        self._tokens[a] -= given_back(placement, self._scale)
        if self._requests[a] <= 0:
            del self._requests[a]
            self._tokens.pop(a, None)

    def requests(self, address: str) -> int:
        return self._requests.get(address, 0)

    def tokens(self, address: str) -> int:
        return self._tokens.get(address, 0)

    def total(self) -> int:
        return sum(self._requests.values())

    def units_changed(self, factor: float) -> None:
        """Token estimates are now `factor` times what they were (approximate mode changed
        its bytes per token): the in-flight prompts are counted in the new unit, as the
        requests placed from now on are, so a ceiling in the new unit (flow control's
        detector) is not measured against prompts counted in the old one for as long as
        they run. Each placement gives back its share in the new unit (`Placement.scale`);
        an endpoint's count is exact again once nothing is in flight there."""
        if factor <= 0:
            return
        self._scale *= factor
        self._tokens = rescaled(self._tokens, factor)
