"""In-flight accounting: requests (and their estimated prompt tokens) placed on each endpoint
and not yet finished. Incremented at the decision, released when the ext_proc stream ends."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Placement:
    """What one decision added; handed back to `release` exactly once."""

    address: str
    tokens: int


class InFlightCounter(Protocol):
    """What the router needs from in-flight accounting: synchronous, never awaiting, so the
    hot path cannot stall on a shared store (`SharedInFlight` syncs in the background)."""

    def acquire(self, address: str, tokens: int) -> Placement: ...
    def release(self, placement: Placement) -> None: ...
    def requests(self, address: str) -> int: ...
    def tokens(self, address: str) -> int: ...
    def total(self) -> int: ...


class InFlight:
    """Process-local counts. Not thread-safe: used from the event loop only."""

    def __init__(self) -> None:
        self._requests: Counter[str] = Counter()
        self._tokens: Counter[str] = Counter()

    def acquire(self, address: str, tokens: int) -> Placement:
        self._requests[address] += 1
        self._tokens[address] += tokens
        return Placement(address, tokens)

    def release(self, placement: Placement) -> None:
        a = placement.address
        self._requests[a] -= 1
        self._tokens[a] -= placement.tokens
        if self._requests[a] <= 0:
            del self._requests[a]
            self._tokens.pop(a, None)

    def requests(self, address: str) -> int:
        return self._requests.get(address, 0)

    def tokens(self, address: str) -> int:
        return self._tokens.get(address, 0)

    def total(self) -> int:
        return sum(self._requests.values())
