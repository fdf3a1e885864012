"""Live endpoint state: the latest scraped figures per endpoint and how old they are.

The scraper writes here (`update`, `retain`); the router reads `state()` per candidate on
the hot path and adds in-flight counts, which it owns.

Besides the engine's gauges, each scrape says how many of its requests are still before
their first token (`EndpointState.prefilling`): waiting + running less those decoding, and
decoding = first tokens produced (`time_to_first_token_seconds` count, observed at the first
token) less requests finished (`request_success_total`, every reason), both counted since
the engine started. A request aborted before its first token is finished without a first
token, so that difference undercounts decoding by every such abort since the start; the
largest deficit ever seen (finished - first tokens, which is exactly the aborts' count
whenever nothing is decoding) is added back. Until it is seen the count errs towards more
requests in prefill, i.e. towards the older floor that counted every request.
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
        # address -> (engine start, first tokens, finished, aborts before a first token as
        # a lower bound, requests before their first token); see the module docstring.
        self._prefill: dict[str, tuple[float | None, float, int, float, int]] = {}

    def put_attribute(self, address: str, key: str, value: float) -> None:
        self._attributes.setdefault(address, {})[key] = value

    def drop_attribute(self, address: str, key: str) -> None:
        """The source no longer knows it: plugins then see it as missing."""
        attrs = self._attributes.get(address)
        if attrs is not None:
            attrs.pop(key, None)

    def update(self, address: str, scraped: Scraped, *, age_s: float = 0.0) -> None:
        """Stores `scraped`, taken `age_s` seconds ago (a peer replica's scrape reaches
        this one a publish interval after it was taken; its age counts from then)."""
        self._latest[address] = (scraped, self._clock() - max(0.0, age_s))
        lat = scraped.latency
        if lat is None or scraped.finished is None:
            # Not exported (sglang, an older vLLM): unknown. (No first-token histogram with
            # a finished count reads as nothing decoding: every request counts as prefill.)
            self._prefill.pop(address, None)
            return
        first, done = lat.ttft_count, scraped.finished
        gap = first - done  # decoding - aborts before a first token
        aborts = max(0.0, -gap)
        prev = self._prefill.get(address)
        if prev is not None and (
            prev[0] == scraped.process_start_s and first >= prev[1] and done >= prev[2]
        ):
            # Same engine (counters only grow): the aborts' count never shrinks.
            aborts = max(aborts, prev[3])
        decoding = min(scraped.running, max(0, round(gap + aborts)))
        pending = scraped.waiting + scraped.running - decoding
        self._prefill[address] = (scraped.process_start_s, first, done, aborts, pending)

    def retain(self, addresses: Collection[str]) -> None:
        """Forget every endpoint not in `addresses` (it left the pool)."""
        for gone in [a for a in self._latest if a not in addresses]:
            del self._latest[gone]
        for gone in [a for a in self._attributes if a not in addresses]:
            del self._attributes[gone]
        for gone in [a for a in self._prefill if a not in addresses]:
            del self._prefill[gone]

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
        prefill = self._prefill.get(address)
        if prefill is not None:
            extra["prefilling"] = prefill[4]
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
