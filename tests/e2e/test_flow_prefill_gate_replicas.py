"""The prefill gate's fleet view behind real Envoys: two `extproc serve` replicas sharing one
Redis and one simulated vLLM server with a slow prefill (a long prompt takes ~2 s), each
replica behind its own Envoy so the test decides which replica places what (one Envoy
round-robins its streams over the replicas as it likes).

Replica Y gets an interactive request (its band is active there for 10 s). Replica X then
places a long batch prompt. While it prefills, a short batch request reaches Y. The engine
shows one request before its first token: X's long one. With the fleet view, Y knows X's
placement with its size and time (shared flow state) and holds the short one until the
long prefill's first token. Without it, Y takes the engine's unfinished request for its own
(short, done) interactive one, and releases the short request at once behind the long
prefill: the per-replica gate's blind spot (bench/RESULTS.md, eleventh session, m6)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator

import httpx
import pytest

from extproc.stack import SimFleet, Stack, StackOptions, wait_until
from tests.e2e.flow_configs import prefill_gate_config
from tests.e2e.test_flow_prefill_gate import (
    HI,
    LO,
    LONG,
    PREFILL_TPS,
    SHORT,
    body,
    estimate,
    first_token,
)
from tests.redis_servers import RedisServer


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[SimFleet]:
    sim = ("--prefill-tps", str(PREFILL_TPS), "--decode-tps", "100")
    f = SimFleet(1, sim, log_dir=tmp_path_factory.mktemp("gatefleet"))
    try:
        yield f
    finally:
        f.close()


def config(tmp, fleet_view: bool):
    # The short prompt fits beside another short one's unfinished prefill, not the long one's.
    budget = (2 * estimate(SHORT) + estimate(LONG + SHORT)) // 2
    return prefill_gate_config(tmp, {"maxPrefillTokens": budget, "fleetView": fleet_view})


def metric(port: int, pattern: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(float(m) for m in re.findall(pattern, text, re.M))


HELD = r"^extproc_flow_prefill_gate_held_total (\S+)$"


@pytest.mark.parametrize("fleet_view", [True, False], ids=["fleet-view", "per-replica"])
async def test_a_replica_holds_batch_behind_the_other_replicas_prefill(
    fleet: SimFleet, redis_server: RedisServer, tmp_path, fleet_view: bool
):
    path = config(tmp_path, fleet_view)
    # The engine is shared: without this, the second case's prompts (the same seeds) were
    # cached from the first's, the long one had its first token before the short one was
    # sent, and the per-replica case proved nothing (measured).
    fleet.reset()
    # One Redis and one engine for both parametrisations: the first one's replicas withdraw
    # their shared entries at stop, and its requests have ended.
    opts = {"fleet": fleet, "redis_url": redis_server.url, "extproc_args": ("--config", str(path))}
    with Stack(StackOptions(**opts)) as x, Stack(StackOptions(**opts)) as y:
        wait_until(
            lambda: metric(y.picker_admin_port, r"^extproc_flow_shared_peers (\S+)$") == 1,
            timeout_s=20,
            what="the replicas see each other",
        )
        model = fleet.model
        async with (
            httpx.AsyncClient(base_url=x.url, timeout=60) as cx,
            httpx.AsyncClient(base_url=y.url, timeout=60) as cy,
        ):
            hi = await cy.post("/v1/chat/completions", json=body(model, 1, SHORT), headers=HI)
            assert hi.status_code == 200  # interactive is active at Y from now (10 s)

            loop = asyncio.get_running_loop()
            engine_has_it: asyncio.Future[None] = loop.create_future()

            async def long_at_x() -> float:
                """When its first token came."""
                req = body(model, 2, LONG)
                async with cx.stream("POST", "/v1/chat/completions", json=req, headers=LO) as r:
                    assert r.status_code == 200
                    engine_has_it.set_result(None)  # the sim answers headers before prefill
                    async for line in r.aiter_lines():
                        if first_token(line):
                            return time.perf_counter()
                raise AssertionError("no first token")

            async def short_at_y() -> float:
                start = time.perf_counter()
                req = body(model, 3, SHORT)
                async with cy.stream("POST", "/v1/chat/completions", json=req, headers=LO) as r:
                    headers_s = time.perf_counter() - start
                    assert r.status_code == 200
                    async for _ in r.aiter_lines():
                        pass
                return headers_s

            long_task = asyncio.create_task(long_at_x())
            await asyncio.wait_for(engine_has_it, 30)
            await asyncio.sleep(0.3)  # a few exchanges (0.1 s) and scrapes: Y may know
            if fleet_view:
                peers = r"^extproc_flow_prefill_gate_peer_placements{[^}]*} (\S+)$"
                assert metric(y.picker_admin_port, peers) >= 1, "X's placement not seen at Y"
            sent_short = time.perf_counter()
            short_s = await short_at_y()
            # From sending the short one (before it, when the long prompt was cached: < 0).
            long_ttft = await long_task - sent_short
        held_at_y = metric(y.picker_admin_port, HELD)
    assert long_ttft > 1.0, "the long prefill was too short to tell"
    if fleet_view:
        # Held at Y until X's long prefill produced its first token.
        assert short_s > long_ttft, "Y released batch behind X's unfinished prefill"
        assert held_at_y >= 1
    else:
        # Y's own view: the engine's unfinished request taken for its own short one.
        assert short_s < long_ttft - 0.5, "held without the fleet view: the test shows nothing"
        assert held_at_y == 0
