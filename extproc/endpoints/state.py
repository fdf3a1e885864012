"""Live endpoint state: the latest scraped figures per endpoint and how old they are.

The scraper writes here (`update`, `retain`); the router reads `state()` per candidate on
the hot path and adds in-flight counts, which it owns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from extproc.core import EndpointState

# Figures older than this are stale: scoring treats them as missing (a few scrape intervals).
DEFAULT_STALE_AFTER_S = 0.2

if TYPE_CHECKING:
    from extproc.endpoints.exposition import Scraped


class EndpointStates:
    """Latest `Scraped` per endpoint address, stamped with `clock()` when stored.

    `clock` is monotonic seconds (injected so tests step it). Figures older than
    `stale_after_s` are stale; an endpoint never scraped is stale with `age_s` None. Stale
    figures are still returned: scorers decide what age means. Event-loop use only.
    """

    def __init__(
        self,
        *,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if stale_after_s <= 0:
            raise ValueError("stale_after_s must be positive")
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._latest: dict[str, tuple[Scraped, float]] = {}
        # address -> attribute -> value, from sources besides the engine (DCGM).
        self._attributes: dict[str, dict[str, float]] = {}

    def put_attribute(self, address: str, key: str, value: float) -> None:
        self._attributes.setdefault(address, {})[key] = value

    def drop_attribute(self, address: str, key: str) -> None:
        """The source no longer knows it: plugins then see it as missing."""
        attrs = self._attributes.get(address)
        if attrs is not None:
            attrs.pop(key, None)

    def update(self, address: str, scraped: Scraped) -> None:
        self._latest[address] = (scraped, self._clock())

    def retain(self, addresses: Collection[str]) -> None:
        """Forget every endpoint not in `addresses` (it left the pool)."""
        for gone in [a for a in self._latest if a not in addresses]:
            del self._latest[gone]
        for gone in [a for a in self._attributes if a not in addresses]:
            del self._attributes[gone]

    def scraped(self, address: str) -> Scraped | None:
        entry = self._latest.get(address)
        return entry[0] if entry else None

    def age_s(self, address: str) -> float | None:
        """Seconds since `address` was last scraped; None if never."""
        entry = self._latest.get(address)
        return None if entry is None else max(0.0, self._clock() - entry[1])

    def is_stale(self, address: str) -> bool:
        age = self.age_s(address)
        return age is None or age > self.stale_after_s

    def state(
        self, address: str, inflight_requests: int = 0, inflight_tokens: int = 0
    ) -> EndpointState:
        """The scheduler's view of `address`: scraped figures, their age, in-flight counts."""
        entry = self._latest.get(address)
        attrs = self._attributes.get(address)
        extra: dict[str, Any] = {"attributes": dict(attrs)} if attrs else {}
        if entry is None:
            return EndpointState(
                inflight_requests=inflight_requests, inflight_tokens=inflight_tokens, **extra
            )
        s, at = entry
        age = max(0.0, self._clock() - at)
        return EndpointState(
            waiting=s.waiting,
            running=s.running,
            kv_usage=s.kv_usage,
            inflight_requests=inflight_requests,
            inflight_tokens=inflight_tokens,
            age_s=age,
            is_stale=age > self.stale_after_s,
            kv_block_size=s.kv_block_size,
            kv_blocks=s.kv_blocks,
            max_adapters=s.max_adapters,
            running_adapters=s.running_adapters,
            waiting_adapters=s.waiting_adapters,
            **extra,
        )

    def __contains__(self, address: object) -> bool:
        return address in self._latest

    def __len__(self) -> int:
        return len(self._latest)
