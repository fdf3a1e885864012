"""The loop that teaches a `LatencyModel`: every `interval_s` it reads each endpoint's latest
scrape from `EndpointStates` (the metrics scraper's output) and feeds its latency histograms
to the model. Fitting happens here, never on the request path.

A model that cannot learn says so: when scraping is off, or an endpoint exports no latency
histograms, a warning is logged once and `missing` lists it (exported as a metric), since
predictions then stand on the fleet's figures or are absent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from extproc.endpoints.pool import EndpointPool
from extproc.endpoints.state import EndpointStates
from extproc.latency.model import LatencyModel

log = logging.getLogger("extproc.latency")

# Scrapes of an endpoint without latency histograms before it is reported as missing them.
_GRACE_SCRAPES = 3


class LatencyLearner:
    """Feeds `model` from `states` (None: metrics scraping is off) for the endpoints of `pool`."""

    def __init__(
        self,
        model: LatencyModel,
        pool: EndpointPool,
        states: EndpointStates | None,
        *,
        interval_s: float = 0.05,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.model = model
        self._pool = pool
        self._states = states
        self._interval = interval_s
        self._sleep = sleep
        self._without: dict[str, int] = {}  # address -> scrapes seen without histograms
        self.missing: set[str] = set()  # endpoints reported as exporting no histograms
        self._seen: dict[str, object] = {}  # address -> last Scraped fed (identity)
        self._snapshot: object = None

    @property
    def scraping(self) -> bool:
        return self._states is not None

    async def run(self) -> None:
        if self._states is None:
            log.warning(
                "latency model: metrics scraping is off, so it cannot learn; latency plugins "
                'fall back to load scores (extproc_latency_endpoints{state="unlearned"})'
            )
            return
        while True:
            self.step()
            await self._sleep(self._interval)

    def step(self) -> None:
        """One pass over the pool (the loop body; tests call it directly)."""
        states = self._states
        if states is None:
            return
        endpoints = self._pool.snapshot()
        if endpoints is not self._snapshot:
            self._snapshot = endpoints
            addresses = {e.address for e in endpoints}
            self.model.retain(addresses)
            for table in (self._without, self._seen):
                for gone in [a for a in table if a not in addresses]:
                    del table[gone]
            self.missing &= addresses
        for e in endpoints:
            address = e.address
            scraped = states.scraped(address)
            if scraped is None or self._seen.get(address) is scraped:
                continue  # not scraped yet, or nothing new since the last pass
            self._seen[address] = scraped
            if scraped.latency is None:
                n = self._without[address] = self._without.get(address, 0) + 1
                if n == _GRACE_SCRAPES and address not in self.missing:
                    self.missing.add(address)
                    log.warning(
                        "latency model: endpoint %s exports no latency histograms "
                        "(vllm:request_prefill_time_seconds ...); its latency is predicted "
                        "from the fleet's",
                        address,
                    )
                continue
            if address in self.missing:
                self.missing.discard(address)
                log.info("latency model: endpoint %s now exports latency histograms", address)
            self._without.pop(address, None)
            age = states.age_s(address) or 0.0
            self.model.learn(
                address, scraped.latency, scraped.running, scraped.waiting,
                self.model.now() - age,
            )  # fmt: skip
