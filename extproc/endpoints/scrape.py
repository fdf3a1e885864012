"""The scrape loop: polls every endpoint's `/metrics` and stores what it says in
`EndpointStates`, where scheduling reads it. Reading the text is `exposition.py`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Literal, Protocol

import msgspec
from xxhash import xxh3_64_intdigest

from extproc.core import LatencyTotals
from extproc.endpoints.exposition import MetricsError, Scraped, parse_metrics
from extproc.endpoints.fetcher import MetricsFetcher
from extproc.endpoints.pool import EndpointPool
from extproc.endpoints.state import DEFAULT_STALE_AFTER_S, EndpointStates

# Re-exported: callers that read scraped figures imported them from here before the split.
__all__ = [
    "LatencyTotals",
    "MetricsError",
    "MetricsScraper",
    "ScrapeSettings",
    "ScrapeStats",
    "Scraped",
    "parse_metrics",
]

log = logging.getLogger(__name__)


class ScrapeSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Metrics scraping.

    `interval_s`: how often each endpoint is scraped (the reference picker: 50 ms).
    `timeout_s`: per scrape, connect to last byte. `stale_after_s`: figures older than this
    are stale (reference: 200 ms). `max_backoff_s`: a failing endpoint is retried after
    interval, 2x, 4x, ... up to this. `max_body_bytes`: an answer whose Content-Length
    says more is a failure (unsized bodies are bounded by `timeout_s` only).
    """

    interval_s: Annotated[float, msgspec.Meta(gt=0)] = 0.05
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 0.2
    stale_after_s: Annotated[float, msgspec.Meta(gt=0)] = DEFAULT_STALE_AFTER_S
    path: Annotated[str, msgspec.Meta(pattern="^/")] = "/metrics"
    scheme: Literal["http", "https"] = "http"
    max_backoff_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    max_body_bytes: Annotated[int, msgspec.Meta(gt=0)] = 16 << 20
    # https only: verify the server's certificate (against `tls_ca_file`, else the system
    # CAs) and address. Off by default, as in llm-d (`insecureSkipVerify: true`).
    tls_verify: bool = False
    tls_ca_file: str | None = None


@dataclass(slots=True)
class ScrapeStats:
    """Counters since start: successful scrapes and failed ones (all endpoints), and cache
    invalidations by reason (`restart`: the process start time changed; `unreachable`: an
    outage that means the cache is gone, once per outage; see `MetricsScraper._cache_lost`)."""

    scrapes: int = 0
    failures: int = 0
    invalidations: dict[str, int] = field(default_factory=dict)
    # Scrapes whose body was byte-for-byte the last one's (by hash): not parsed again.
    unchanged: int = 0
    # CPU seconds spent hashing, parsing and storing bodies (this thread's clock).
    parse_cpu_s: float = 0.0
    connects: int = 0  # connections opened to endpoints (kept alive across scrapes)
    # Invalidations whose index call raised: the endpoint's old blocks may still be credited
    # to it (a bug or an index outage), so routing can follow a cache that is gone.
    invalidate_failures: int = 0


@dataclass(slots=True)
class _Health:
    fetcher: MetricsFetcher
    failing: int = 0  # consecutive failures
    failing_since: float = 0.0  # the first of them (the scraper's clock)
    slow: bool = False  # every one of them a timeout
    failures: int = 0  # since the endpoint joined the pool
    retry_at: float = 0.0
    started: float | None = None  # the engine's process start time, as last scraped
    forgotten: bool = False  # this outage already invalidated what the index credits it with
    digest: int | None = None  # hash of the last parsed body
    scraped: Scraped | None = None  # what that body said


# Consecutive timed-out scrapes before an endpoint counts as down (see `is_failing`).
_SLOW_FAILURES = 3


class ScrapeShare(Protocol):
    """Replicas dividing the scrapes among themselves (server/shared_scrapes.py): whether
    this replica scrapes `address` at this tick, and what it scraped, to pass on."""

    def wants(self, address: str) -> bool: ...

    def scraped(self, address: str, scraped: Scraped) -> None: ...


class MetricsScraper:
    """Scrapes every endpoint of `pool` each `interval_s` into `states`, until cancelled.

    Endpoints are scraped concurrently and independently: a slow one does not delay the
    others' next scrape (at most one scrape per endpoint is outstanding). A failure marks
    nothing by itself; the endpoint's figures simply age in `states`. Failures are counted
    per endpoint and logged once when an endpoint starts failing and once when it recovers.
    Endpoints that leave the pool are dropped from `states`. `clock` (seconds, monotonic)
    paces the retry backoff; `sleep` paces the loop.
    """

    def __init__(
        self,
        pool: EndpointPool,
        states: EndpointStates,
        settings: ScrapeSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
        on_invalidate: Callable[[str, str], Awaitable[None]] | None = None,
        on_scrape: Callable[[str, Scraped, float], None] | None = None,
    ) -> None:
        """`on_invalidate(address, reason)` is awaited when what the index believes about
        an endpoint's cache can no longer be true: its process restarted (empty cache), or
        it refused or answered wrongly (dead, or restarting). Within one scrape interval of a
        refused connection. Timeouts alone take a server out of routing after three in a row
        (`is_failing`) but keep its cache, unless its start time is unknown (`_cache_lost`)."""
        self._on_invalidate = on_invalidate
        # Each successful scrape (address, figures, seconds since taken): approximate-mode
        # calibration, prefill speeds.
        self._on_scrape = on_scrape
        self._pool = pool
        self._states = states
        self._s = settings if settings is not None else ScrapeSettings()
        self._clock = clock
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._health: dict[str, _Health] = {}
        self._pending: set[str] = set()
        self._snapshot: object = None
        # When the figures last stored per endpoint were taken (this clock): a peer's scrape
        # older than them is dropped.
        self._taken: dict[str, float] = {}
        self._invalidations: set[asyncio.Task[None]] = set()
        # Set when replicas share scrapes: endpoints a peer scrapes are skipped here while
        # its figures arrive (`wants`), and this replica's scrapes are passed on.
        self.share: ScrapeShare | None = None
        self.stats = ScrapeStats()

    def failures(self, address: str) -> int:
        """Failed scrapes of `address` since it joined the pool."""
        h = self._health.get(address)
        return h.failures if h else 0

    def is_failing(self, address: str) -> bool:
        """`address` looks down: its last scrape was refused or answered wrongly, or
        `_SLOW_FAILURES` scrapes in a row timed out. A single timeout is a busy server (a
        long prefill on a loaded host), not a gone one: taken for one, it cost the server
        its traffic and, through invalidation, everything the index credited it with."""
        h = self._health.get(address)
        return bool(h and h.failing and (not h.slow or h.failing >= _SLOW_FAILURES))

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tasks:
                while True:
                    self._tick(tasks)
                    await self._sleep(self._s.interval_s)
        finally:
            for h in self._health.values():
                h.fetcher.close()

    def _tick(self, tasks: asyncio.TaskGroup) -> None:
        endpoints = self._pool.snapshot()
        if endpoints is not self._snapshot:
            self._snapshot = endpoints
            self._follow_pool({e.address for e in endpoints})
        now = self._clock()
        share = self.share
        for address, h in self._health.items():
            if address not in self._pending and now >= h.retry_at:
                if share is not None and not share.wants(address):
                    continue
                self._pending.add(address)
                tasks.create_task(self._scrape(address, h), name=f"scrape {address}")

    def _follow_pool(self, addresses: set[str]) -> None:
        s = self._s
        for gone in self._health.keys() - addresses:
            self._health.pop(gone).fetcher.close()
            self._taken.pop(gone, None)
        for new in addresses - self._health.keys():
            fetcher = MetricsFetcher(
                new,
                s.path,
                scheme=s.scheme,
                max_body_bytes=s.max_body_bytes,
                tls_verify=s.tls_verify,
                tls_ca_file=s.tls_ca_file,
            )
            self._health[new] = _Health(fetcher)
        self._states.retain(addresses)

    async def _scrape(self, address: str, h: _Health) -> None:
        try:
            connects = h.fetcher.connects
            try:
                async with asyncio.timeout(self._s.timeout_s):
                    body = await h.fetcher.fetch()
            finally:
                self.stats.connects += h.fetcher.connects - connects
            scraped = self._read(h, body)
        except Exception as exc:  # any failure of one endpoint is that endpoint's, not ours
            self._failed(address, h, exc)
            if self._health.get(address) is h and self._cache_lost(address, h):
                h.forgotten = True
                await self._invalidate(address, "unreachable")
        else:
            if self._health.get(address) is h:  # still in the pool
                self.stats.scrapes += 1
                restarted = self._store(address, h, scraped, 0.0)
                if self.share is not None:
                    self.share.scraped(address, scraped)
                if restarted:
                    await self._invalidate(address, "restart")
        finally:
            self._pending.discard(address)

    def _store(self, address: str, h: _Health, scraped: Scraped, age_s: float) -> bool:
        """Stores what a scrape taken `age_s` ago says (this replica's or a peer's); True
        when it shows the engine restarted."""
        self._taken[address] = self._clock() - age_s
        self._states.update(address, scraped, age_s=age_s)
        if self._on_scrape is not None:
            self._on_scrape(address, scraped, age_s)
        if h.failing:
            log.info(
                "endpoint %s: metrics back after %d failures, %.1f s stale",
                address,
                h.failing,
                self._clock() - h.failing_since,
            )
            h.failing = 0
            h.slow = False
            h.forgotten = False
            h.retry_at = 0.0
        started, h.started = h.started, scraped.process_start_s
        if started is not None and scraped.process_start_s not in (None, started):
            log.warning("endpoint %s restarted: its cached blocks are forgotten", address)
            return True
        return False

    def apply(self, address: str, scraped: Scraped, age_s: float) -> bool:
        """A peer replica's scrape of `address`, taken `age_s` seconds ago: stored as this
        replica's own would be (figures, calibration, prefill speed, a restart's
        invalidation). False, and nothing stored, for an endpoint not in the pool, or
        figures older than those stored (a peer's batch late behind this replica's own
        scrape), which would read as counters going back."""
        h = self._health.get(address)
        if h is None or self._clock() - age_s < self._taken.get(address, -float("inf")):
            return False
        if self._store(address, h, scraped, age_s):
            task = asyncio.get_running_loop().create_task(self._invalidate(address, "restart"))
            self._invalidations.add(task)
            task.add_done_callback(self._invalidations.discard)
        return True

    def _cache_lost(self, address: str, h: _Health) -> bool:
        """Whether this failure means the endpoint's cache must be taken as gone (once per
        outage): it is failing, and not only by timeouts of a process whose start time we
        know. A server that stops answering in time (frozen, or starved of CPU on a loaded
        host) still holds its cache; it is out of routing while failing, and when it answers
        again a new start time (`restart`) is what says the cache went. Forgetting it at the
        third timeout emptied the index of busy servers that never restarted. A refused or
        wrong answer (a dead or restarting process), or an engine without a start time,
        still invalidates at once."""
        if h.forgotten or not self.is_failing(address):
            return False
        return not (h.slow and h.started is not None)

    def _read(self, h: _Health, body: bytes) -> Scraped:
        """The body's figures; an idle engine's body repeats itself, so a body equal to the
        last one (by a 64-bit hash, ~5 us for a 54 KB vLLM scrape) is not parsed again."""
        t0 = time.thread_time()
        try:
            digest = xxh3_64_intdigest(body)
            if digest == h.digest and h.scraped is not None:
                self.stats.unchanged += 1
                return h.scraped
            h.digest = h.scraped = None
            scraped = parse_metrics(body)
            h.digest, h.scraped = digest, scraped
            return scraped
        finally:
            self.stats.parse_cpu_s += time.thread_time() - t0

    async def _invalidate(self, address: str, reason: str) -> None:
        inv = self.stats.invalidations
        inv[reason] = inv.get(reason, 0) + 1
        if self._on_invalidate is not None:
            try:
                await self._on_invalidate(address, reason)
            except Exception:  # the scrape loop must outlive a failing index
                self.stats.invalidate_failures += 1
                log.exception("endpoint %s: invalidating its cached blocks failed", address)

    def _failed(self, address: str, h: _Health, exc: BaseException) -> None:
        self.stats.failures += 1
        h.failures += 1
        h.failing += 1
        # Slow only while every failure of this run is a timeout.
        h.slow = isinstance(exc, TimeoutError) and (h.slow or h.failing == 1)
        if h.failing == 1:
            h.failing_since = self._clock()
            log.warning(
                "endpoint %s: metrics scrape failing (%s); its figures will go stale",
                address,
                _reason(exc),
            )
        backoff = min(self._s.max_backoff_s, self._s.interval_s * 2 ** min(h.failing - 1, 16))
        # Jitter keeps a fleet of pickers from retrying a recovering server in lockstep.
        h.retry_at = self._clock() + backoff * (0.5 + 0.5 * self._rng.random())


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__
