"""Three `extproc serve` replicas sharing one Redis behind one Envoy measure the KV-capacity
ratio (engine prompt tokens per estimated token: how much of each server's cache the
approximate index credits it with, index/capacity.py) from their first requests with
`index.capacity_first_tokens`.

Each replica places a third of the requests; the first measurement waited for 20,000
estimated tokens of a replica's own, checked every 32 of its decisions. On tenants at 24
req/s that was 3-4 s, while the estimates were uncalibrated (4 bytes per token against the
simulator's ~1.3 characters): the 1.0 prior credited each server with ~3x its cache and
three replicas sent tenants to "holders" that had evicted them (bench/RESULTS.md, issue 14,
twelfth session). Calibration is off here so the ratio stays in one unit: 4 bytes per
token, ~3 engine tokens per estimated one.

With calibration on and a Redis index, replicas pool their calibration by default
(`state.shared_calibration: auto`, server/shared_calibration.py) and the peers' placements
then make the first measurement early without the setting; one replica alone keeps the
default first measurement (early on one replica lost: thirteenth session)."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import httpx
import pytest

from extproc.sim.workload import send_one
from extproc.stack import Stack, StackOptions
from tests.e2e.calibration_workload import SIM, chat_item, gauge, syllable_text
from tests.redis_servers import RedisServer

# 8 batches of 6 requests of ~500 words (~700 estimated tokens each at 4 bytes per token):
# ~16 requests and ~11,000 estimated tokens per replica, under the default 20,000.
BATCHES = 8


async def _scenario(stack: Stack, batches: int = BATCHES) -> list[dict[str, float | None]]:
    admins = [stack.picker_admin_port, *(a for _, _, a in stack.replica_ports)]
    rng = random.Random(7)
    async with aiohttp.ClientSession() as s, httpx.AsyncClient(timeout=10) as h:
        for k in range(batches):
            batch = [chat_item(6 * k + i, f"filler {6 * k + i}: " + syllable_text(rng, 500))
                     for i in range(6)]  # fmt: skip
            done = await asyncio.gather(*(send_one(s, stack.url, b, 30) for b in batch))
            assert all(r.status == 200 for r in done), [r.error for r in done]
            await asyncio.sleep(0.2)  # a few scrapes between batches
        texts = [(await h.get(f"http://127.0.0.1:{p}/metrics")).text for p in admins]
    names = (
        "capacity_token_ratio", "decisions_total", "approx_bytes_per_token",
        "shared_calibration_applied_total",
    )  # fmt: skip
    return [
        {k: gauge(t, f"extproc_{k}") for k in names}
        | {"per_request": gauge(t, 'extproc_capacity_measurements_total{source="per_request"}')}
        for t in texts
    ]


@pytest.mark.parametrize("first", [None, 2000], ids=["default", "first2000"])
def test_each_replica_measures_the_capacity_ratio_from_its_first_requests(
    tmp_path, redis_server: RedisServer, first: int | None
):
    cfg = tmp_path / "picker.yaml"
    cfg.write_text(
        "parse: {calibrate: false}\n"
        + (f"index: {{capacity_first_tokens: {first}}}\n" if first else "")
    )
    opts = StackOptions(
        upstreams=1,
        sim_args=SIM,
        replicas=3,
        redis_url=redis_server.url,
        extproc_args=("--config", str(cfg)),
    )
    with Stack(opts) as stack:
        after = asyncio.run(_scenario(stack))
    # Envoy spread the requests: each replica placed a share, none all of them.
    assert all(4 <= (g["decisions_total"] or 0) < 6 * BATCHES for g in after), after
    assert all(g["approx_bytes_per_token"] == 4 for g in after), after
    if first is None:
        # A third of ~48 requests is far from 20,000 estimated tokens: the 1.0 prior holds.
        assert all(g["capacity_token_ratio"] == 1.0 for g in after), after
        assert all(not g["per_request"] for g in after), after
        return
    # The simulator's ~1.3 characters per token against 4 bytes per token.
    assert all(2.3 < (g["capacity_token_ratio"] or 0) < 4.0 for g in after), after
    assert all((g["per_request"] or 0) >= 1 for g in after), after


@pytest.mark.parametrize("replicas", [3, 1], ids=["pooled", "alone"])
def test_pooled_calibration_measures_the_capacity_ratio_early_by_default(
    tmp_path, redis_server: RedisServer, replicas: int
):
    cfg = tmp_path / "picker.yaml"
    cfg.write_text("{}\n")  # the defaults: calibration on, shared_calibration auto
    opts = StackOptions(
        upstreams=1,
        sim_args=SIM,
        replicas=replicas,
        redis_url=redis_server.url,
        extproc_args=("--config", str(cfg)),
    )
    # 24 requests (~17,000 estimated tokens at 4 bytes per token): under the default's
    # 20,000 and 32 placements between measurements, pooled or not.
    with Stack(opts) as stack:
        after = asyncio.run(_scenario(stack, 4))
    if replicas == 1:
        # Pooling is on (a Redis index) but nobody else places: nothing pooled, no early
        # measurement.
        assert not after[0]["shared_calibration_applied_total"], after
        assert after[0]["capacity_token_ratio"] == 1.0 and not after[0]["per_request"], after
        return
    assert all(2 <= (g["decisions_total"] or 0) < 24 for g in after), after
    # Each replica counted its peers' placements (pooled by default) and measured early.
    assert all((g["shared_calibration_applied_total"] or 0) > 0 for g in after), after
    assert all((g["per_request"] or 0) >= 1 for g in after), after
    assert all(g["capacity_token_ratio"] != 1.0 for g in after), after
