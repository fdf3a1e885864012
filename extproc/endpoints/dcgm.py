"""GPU utilization from NVIDIA's DCGM exporter, as the endpoint attribute `GPUUtilization`
(0..1), for llm-d's `dcgm-data-source` / `dcgm-extractor` and the endpoint-attribute
plugins that read it.

Each endpoint's host is polled at `port` (the exporter runs per node, 9400 by default);
the value is the highest `DCGM_FI_DEV_GPU_UTIL` sample labelled with the endpoint's pod
name (samples without a `pod` label count for every endpoint on the host), divided by 100.
A failed poll or a missing metric removes the attribute, so plugins see it as missing;
failures are counted and logged when an endpoint starts and stops failing.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Literal

import aiohttp
import msgspec

from extproc.endpoints.fetcher import tls_context
from extproc.endpoints.pool import EndpointPool
from extproc.endpoints.state import EndpointStates

log = logging.getLogger("extproc.endpoints.dcgm")

ATTRIBUTE = "GPUUtilization"
METRIC = b"DCGM_FI_DEV_GPU_UTIL"
_SAMPLE = re.compile(rb"^DCGM_FI_DEV_GPU_UTIL(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)", re.M)
_POD = re.compile(rb'(?:^|,)\s*pod="(?P<pod>[^"]*)"')


class DCGMSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where the DCGM exporter answers, relative to each endpoint's host."""

    scheme: Literal["http", "https"] = "http"
    path: Annotated[str, msgspec.Meta(pattern="^/")] = "/metrics"
    port: Annotated[int, msgspec.Meta(gt=0, le=65535)] = 9400
    interval_s: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    # https only: verify the exporter's certificate (against `tls_ca_file`, else the system
    # CAs). Off by default, like metric scrapes and llm-d's `insecureSkipVerify: true`: an
    # exporter serves its own certificate.
    tls_verify: bool = False
    tls_ca_file: str | None = None


def gpu_utilization(body: bytes, pod: str) -> float | None:
    """The pod's highest GPU utilization in a DCGM exporter page, 0..1; None when absent."""
    best: float | None = None
    for m in _SAMPLE.finditer(body):
        labels = m.group("labels") or b""
        owner = _POD.search(labels)
        if pod and owner is not None and owner.group("pod").decode() != pod:
            continue
        try:
            value = float(m.group("value"))
        except ValueError:
            continue
        if value == value:  # NaN is no figure
            best = value if best is None else max(best, value)
    return None if best is None else best / 100.0


@dataclass(slots=True)
class DCGMStats:
    polls: int = 0
    failures: int = 0


class DCGMScraper:
    """Polls each endpoint's host every `interval_s` into `states` (attribute
    `GPUUtilization`) until cancelled; one poll per endpoint outstanding at a time."""

    def __init__(
        self,
        pool: EndpointPool,
        states: EndpointStates,
        settings: DCGMSettings,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._pool = pool
        self._states = states
        self._s = settings
        self._sleep = sleep
        self._pending: set[str] = set()
        self._failing: set[str] = set()
        self.stats = DCGMStats()

    def url(self, address: str) -> str:
        host = address.rpartition(":")[0] or address
        return f"{self._s.scheme}://{host}:{self._s.port}{self._s.path}"

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self._s.timeout_s)
        tls = tls_context(self._s.tls_verify, self._s.tls_ca_file)
        connector = aiohttp.TCPConnector(ssl=tls)
        async with (
            aiohttp.ClientSession(timeout=timeout, connector=connector) as http,
            asyncio.TaskGroup() as tasks,
        ):
            while True:
                endpoints = self._pool.snapshot()
                self._states.retain({e.address for e in endpoints})
                for e in endpoints:
                    if e.address not in self._pending:
                        self._pending.add(e.address)
                        tasks.create_task(self._poll(http, e.address, e.name))
                await self._sleep(self._s.interval_s)

    async def _poll(self, http: aiohttp.ClientSession, address: str, pod: str) -> None:
        try:
            value: float | None = None
            problem = ""
            try:
                async with asyncio.timeout(self._s.timeout_s):
                    async with http.get(self.url(address), allow_redirects=False) as resp:
                        if resp.status != 200:
                            problem = f"HTTP {resp.status}"
                        else:
                            value = gpu_utilization(await resp.read(), pod)
                            if value is None:
                                problem = f"no {METRIC.decode()} sample for pod {pod!r}"
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                problem = str(exc) or type(exc).__name__
            self.stats.polls += 1
            if value is None:
                self.stats.failures += 1
                self._states.drop_attribute(address, ATTRIBUTE)
                if address not in self._failing:
                    self._failing.add(address)
                    log.warning(
                        "endpoint %s: DCGM GPU utilization unavailable (%s); %s is missing "
                        "for it until it returns",
                        address,
                        problem,
                        ATTRIBUTE,
                    )
                return
            self._states.put_attribute(address, ATTRIBUTE, value)
            if address in self._failing:
                self._failing.discard(address)
                log.info("endpoint %s: DCGM GPU utilization back", address)
        finally:
            self._pending.discard(address)
