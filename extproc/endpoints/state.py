"""Live endpoint state: the latest scraped figures per endpoint and how old they are.

The scraper writes here (`update`, `retain`); the router reads `state()` per candidate on
the hot path and adds in-flight counts, which it owns.

Besides the engine's gauges, each scrape says how many of its requests are still before
their first token (`EndpointState.prefilling`): waiting + running less those decoding, and
decoding = first tokens produced (`time_to_first_token_seconds` count, observed at the first
token) less requests finished (`request_success_total`, every reason but `abort`: see
`Scraped.finished`), both counted since the engine started. A request the client cut
(aborted) is where engines differ:

- not counted as finished (vLLM 0.32: `OutputProcessor.abort_requests` drops the request
  without stats; or counted under `abort`, left out): a cut before its first token leaves no
  trace, but one after it stays among the first tokens for good, so the difference
  overcounts decoding by every such cut. Every request with a first token that is neither
  finished nor cut is running or (preempted) waiting, so first - finished never exceeds
  running + waiting + those cuts: the largest excess ever seen (exact whenever nothing
  waits and every running request decodes) is taken off. Under overload something always
  decodes; this bound still learns at every scrape that finds no prefill or queue.
- counted as finished under another reason (an engine without `abort`): one cut before its
  first token is finished without a first token, so the difference undercounts decoding by
  every such cut. first - finished never falls below -(those cuts): the largest deficit
  ever seen (exact only whenever nothing decodes, so under overload it may stay short) is
  added back.

Both bounds only grow (reset with a new engine start) and hold for either engine. Until
an uncounted cut is seen the count errs towards fewer requests in prefill (the prefill gate
releases too much), until a counted one is seen towards more. Each correction is per
endpoint in `abort_corrections` (exported as `extproc_endpoint_prefill_abort_correction`)
and said in a warning at most once a minute per endpoint while it grows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from extproc.core import EndpointState
from extproc.throttle import Throttle

# Figures older than this are stale: scoring treats them as missing (a few scrape intervals).
DEFAULT_STALE_AFTER_S = 0.2
# A growing abort correction is said at most this often per endpoint (a cut per second under
# overload would otherwise log a line per scrape).
CORRECTION_LOG_EVERY_S = 60.0

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from extproc.endpoints.exposition import Scraped


@dataclass(frozen=True, slots=True)
class AbortCorrections:
    """What the `prefilling` count corrects for on one endpoint, since its engine started
    (lower bounds, see the module docstring): `counted_before_first` cuts the engine counted
    as finished without a first token (added back to decoding), `uncounted_after_first`
    cuts after a first token it never counted as finished (taken off)."""

    counted_before_first: float = 0.0
    uncounted_after_first: float = 0.0


@dataclass(frozen=True, slots=True)
class _PrefillCount:
    start: float | None  # the engine's process start: its counters begin there
    first: float  # first tokens
    done: int  # finished, every reason
    corrections: AbortCorrections
    pending: int  # requests before their first token


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
        # address -> the latest count of requests before their first token and what it
        # rests on; see the module docstring.
        self._prefill: dict[str, _PrefillCount] = {}
        # A growing correction is said at most once per CORRECTION_LOG_EVERY_S per endpoint
        # and kind.
        self._correction_log = Throttle(every_s=CORRECTION_LOG_EVERY_S)

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
        gap = first - done  # decoding + uncounted cuts after a first token - counted ones
        counted = max(0.0, -gap)
        prev = self._prefill.get(address)
        before = AbortCorrections()
        if prev is not None and (
            prev.start == scraped.process_start_s and first >= prev.first and done >= prev.done
        ):
            # Same engine (counters only grow): the cuts' counts never shrink.
            before = prev.corrections
            counted = max(counted, before.counted_before_first)
        # Requests past their first token, unfinished, are running or (preempted) waiting:
        # any excess over those is cuts the engine never counted.
        excess = gap + counted - (scraped.running + scraped.waiting)
        uncounted = max(0.0, excess, before.uncounted_after_first)
        now = AbortCorrections(counted, uncounted)
        decoding = min(scraped.running, max(0, round(gap + counted - uncounted)))
        pending = scraped.waiting + scraped.running - decoding
        self._prefill[address] = _PrefillCount(scraped.process_start_s, first, done, now, pending)
        if counted > before.counted_before_first:
            self._say(address, "counted_before_first", counted)
        if uncounted > before.uncounted_after_first:
            self._say(address, "uncounted_after_first", uncounted)

    def _say(self, address: str, which: str, value: float) -> None:
        """A growing correction, at most once per CORRECTION_LOG_EVERY_S per endpoint."""
        if which == "counted_before_first":
            what = "cut before their first token were counted as finished (added back)"
        else:
            what = "cut after their first token were never counted as finished (taken off)"
        self._correction_log.warn(
            log,
            f"{address} {which}",
            "endpoint %s: at least %d requests %s: its count of requests decoding is "
            "corrected for them (extproc_endpoint_prefill_abort_correction)",
            address,
            round(value),
            what,
        )

    def abort_corrections(self, address: str) -> AbortCorrections | None:
        """What `prefilling` corrects for on `address` (None: no count kept)."""
        count = self._prefill.get(address)
        return None if count is None else count.corrections

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
            extra["prefilling"] = prefill.pending
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
