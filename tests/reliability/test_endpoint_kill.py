"""A model server killed under load: the picker stops sending it traffic once a scrape fails,
and requests already headed for it are saved by Envoy walking the picker's fallback list
(override-host mode, `server.fallbacks: 1`, the route's retry policy)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import pytest
import yaml

from extproc.sim.engine import EngineSettings
from extproc.sim.server import ServerSettings as SimSettings
from extproc.sim.server import SimServer
from extproc.sim.timing import TimingSettings
from extproc.stack import SimFleet, Stack, StackOptions
from extproc.testing import ExtProcClient
from tests.reliability.conftest import figure
from tests.reliability.harness import chat, picker, route

SCRAPE_S = 0.1


async def test_a_killed_endpoint_stops_getting_decisions_within_a_scrape_interval():
    async with contextlib.AsyncExitStack() as stack:
        sims = [
            await stack.enter_async_context(
                SimServer(SimSettings(engine=EngineSettings(timing=TimingSettings(speed=20.0))))
            )
            for _ in range(3)
        ]
        scrape = {"scrape": {"interval_s": SCRAPE_S, "stale_after_s": 0.5}}
        app = await stack.enter_async_context(picker([s.name for s in sims], state=scrape))
        victim = sims[0]
        decisions: list[tuple[float, str]] = []
        async with ExtProcClient(f"127.0.0.1:{app.port}") as client:
            await asyncio.sleep(3 * SCRAPE_S)  # first scrapes in

            async def drive(seconds: float, first: int) -> None:
                end = time.monotonic() + seconds
                n = first
                while time.monotonic() < end:
                    dest, _ = await route(client, chat(n, 0))  # new prefixes: load decides
                    decisions.append((time.monotonic(), dest))
                    n += 1
                    await asyncio.sleep(0.005)

            await drive(1.0, 0)
            before = {d for _, d in decisions}
            killed_at = time.monotonic()
            await victim.__aexit__(None, None, None)
            shutdown_s = time.monotonic() - killed_at
            await drive(2.0, 10_000)
        after = [(t - killed_at, d) for t, d in decisions if t >= killed_at]
        to_victim = [t for t, d in after if d == victim.name]
        last_s = max(to_victim, default=0.0)
        figure(
            "endpoint_kill_picker",
            scrape_interval_s=SCRAPE_S,
            server_shutdown_s=round(shutdown_s, 3),
            decisions_after_kill=len(after),
            to_killed_endpoint=len(to_victim),
            last_decision_to_it_s=round(last_s, 3),
        )
        assert victim.name in before, "the victim got traffic before the kill"
        # Behaviour: once its scrape fails it gets nothing (a generous 5 intervals to notice,
        # on a shared 2-core machine); the measured figure is printed above.
        assert all(t < 5 * SCRAPE_S for t in to_victim), to_victim
        settled = {d for t, d in after if t >= 5 * SCRAPE_S}
        assert settled == {s.name for s in sims[1:]}


@dataclass
class Fleets:
    """Separate simulator processes, one server each, so one can be killed alone. Quacks
    like the one-process `SimFleet` where `Stack` needs it (`addresses`)."""

    fleets: list[SimFleet]

    @property
    def addresses(self) -> list[str]:
        return [f.addresses[0] for f in self.fleets]


@pytest.fixture
def fleets(tmp_path: Path) -> Iterator[Fleets]:
    started: list[SimFleet] = []
    try:
        for i in range(3):
            d = tmp_path / f"sim{i}"
            d.mkdir()
            started.append(SimFleet(1, ("--fast", "4"), log_dir=d))
        yield Fleets(started)
    finally:
        for f in started:
            f.close()


def test_requests_to_a_killed_server_fail_over_through_envoy(fleets: Fleets, tmp_path: Path):
    """The generated bootstrap raises Envoy's concurrent-retry limit on the model cluster
    (its default of 3 turned the rest of a dead server's requests into 503 overflows), so
    every request that had not started receiving its response walks its fallback list. A
    response already streaming when the server dies cannot be retried by any proxy."""
    cfg = tmp_path / "picker.yaml"
    cfg.write_text(yaml.safe_dump({"state": {"scrape": {"interval_s": SCRAPE_S}}}))
    # The fallback through StackOptions: the stack passes `--fallbacks`, which overrides the
    # config file (a `server.fallbacks` there was silently shadowed by `--fallbacks 0`, and
    # the test passed only while Envoy's retries happened to pick a live server).
    opts = StackOptions(
        lb="override-host", fleet=fleets, fallbacks=1, extproc_args=("--config", str(cfg))
    )  # type: ignore[arg-type]
    with Stack(opts) as stack:
        served, statuses, in_flight_at_kill, failures = asyncio.run(
            _load_with_kill(stack, fleets.fleets[0])
        )
        stats = stack.envoy_stats("cluster.model_servers.")
    p = "cluster.model_servers."
    failed = sum(n for status, n in statuses.items() if status != 200)
    cut_mid_response = stats.get(p + "upstream_cx_destroy_remote_with_active_rq", 0)
    figure(
        "endpoint_kill_envoy",
        requests=sum(statuses.values()),
        failed=failed,
        in_flight_to_victim_at_kill=in_flight_at_kill,
        retries=stats.get(p + "upstream_rq_retry", 0),
        retry_successes=stats.get(p + "upstream_rq_retry_success", 0),
        retry_overflow=stats.get(p + "upstream_rq_retry_overflow", 0),
        connect_failures=stats.get(p + "upstream_cx_connect_fail", 0),
        resets_with_active_request=cut_mid_response,
    )
    victim = fleets.addresses[0]
    assert served.get(victim, 0) > 0, "the victim served before the kill"
    assert in_flight_at_kill > 0, "nothing was in flight to the victim: the test proves nothing"
    assert stats.get(p + "upstream_rq_retry_overflow", 0) == 0
    # Only requests already at the victim when it died can fail (those whose response was
    # streaming cannot be retried by any proxy); everything else walked its fallback list.
    assert failed <= in_flight_at_kill, failures[:3]


async def _load_with_kill(stack: Stack, victim: SimFleet):
    served: dict[str, int] = {}
    statuses: dict[int, int] = {}
    failures: list[str] = []
    in_flight_at_kill = 0
    body = {"model": "tiny", "max_tokens": 48}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:

        async def one(n: int) -> None:
            payload = {**body, "messages": [{"role": "user", "content": f"req {n} " * 30}]}
            async with http.post(f"{stack.url}/v1/chat/completions", json=payload) as r:
                text = await r.read()
                statuses[r.status] = statuses.get(r.status, 0) + 1
                if r.status != 200:
                    failures.append(text[:200].decode(errors="replace"))
                who = r.headers.get("x-served-by", "-")
                served[who] = served.get(who, 0) + 1

        async def client(c: int) -> None:
            n = c
            end = time.monotonic() + 5.0
            while time.monotonic() < end:
                await one(n)
                n += 12

        async def killer() -> None:
            nonlocal in_flight_at_kill
            await asyncio.sleep(2.0)
            # Kill while the victim is serving something (about a third of the requests sit
            # there, but a fast simulated server is sometimes idle for an instant).
            for _ in range(40):
                in_flight_at_kill = _running_on(victim)
                if in_flight_at_kill:
                    break
                await asyncio.sleep(0.025)
            victim.proc.send_signal(signal.SIGKILL)

        await asyncio.gather(killer(), *(client(c) for c in range(12)))
    return served, statuses, in_flight_at_kill, failures


def _running_on(victim: SimFleet) -> int:
    """Requests the victim is serving right now, from its own metrics (running + waiting)."""
    text = httpx.get(f"{victim.servers[0].url}/metrics", timeout=2).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)
