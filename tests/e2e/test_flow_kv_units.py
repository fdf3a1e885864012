"""Flow control's KV ceiling follows a bytes-per-token recalibration, through `extproc serve`
behind Envoy with a simulated vLLM server: the concurrency detector's `kvCacheFraction` is
a ratio of the picker's estimate (estimated tokens per engine KV token) at the configured
bytes per token. The picker starts at 3; the simulator's tokenizer covers ~1.3 characters a
token, so calibration moves to 1 and every estimate triples: the effective fraction, and
with it each server's token ceiling, triples too (before, it stayed at the configured
figure and the ceiling admitted a third of what the operator meant)."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import httpx
import yaml

from extproc.sim.workload import send_one
from extproc.stack import Stack, StackOptions
from tests.e2e.calibration_workload import SIM, chat_item, gauge, syllable_text
from tests.e2e.flow_configs import in_flight_scheduling

FRACTION = 0.5
SCHEDULING = in_flight_scheduling()
SCHEDULING["plugins"][2]["parameters"] = {"concurrencyMode": "tokens", "kvCacheFraction": FRACTION}
CONFIG = {
    "parse": {"bytes_per_token": 3},
    "flow_control": {"admit_per_endpoint": True},
    "scheduling": SCHEDULING,
}


async def _scenario(stack: Stack) -> list[dict[str, float | None]]:
    admin = f"http://127.0.0.1:{stack.picker_admin_port}/metrics"
    rng = random.Random(5)
    seen: list[dict[str, float | None]] = []
    async with aiohttp.ClientSession() as s, httpx.AsyncClient() as h:

        async def gauges() -> dict[str, float | None]:
            text = (await h.get(admin)).text
            g = {
                "bpt": gauge(text, "extproc_approx_bytes_per_token"),
                "fraction": gauge(text, "extproc_flow_detector_kv_fraction"),
                "unknown": gauge(text, "extproc_flow_detector_unknown_capacity_endpoints"),
            }
            seen.append(g)
            return g

        deadline = time.monotonic() + 20
        while (await gauges())["unknown"] != 0:  # the engine's KV size scraped
            assert time.monotonic() < deadline, seen[-1]
            await asyncio.sleep(0.1)
        # Distinct filler until calibration has measured the engine's token counts and
        # changed bytes per token (two windows of >= 16k engine tokens, >= 8 requests).
        n = 0
        while (await gauges())["bpt"] == 3:
            assert n < 400, seen[-1]
            batch = [chat_item(n + i, syllable_text(rng, 500)) for i in range(6)]
            n += len(batch)
            done = await asyncio.gather(*(send_one(s, stack.url, b, 30) for b in batch))
            assert all(r.status == 200 for r in done), [r.error for r in done]
            await asyncio.sleep(0.2)  # a few scrapes between batches
    return seen


def test_the_kv_fraction_follows_a_recalibration(tmp_path):
    cfg = tmp_path / "picker.yaml"
    cfg.write_text(yaml.safe_dump(CONFIG))
    opts = StackOptions(upstreams=1, sim_args=SIM, extproc_args=("--config", str(cfg)))
    with Stack(opts) as stack:
        seen = asyncio.run(_scenario(stack))
    before, after = seen[0], seen[-1]
    assert before["bpt"] == 3 and before["fraction"] == FRACTION, seen
    bpt = after["bpt"]
    assert bpt is not None and bpt < 3, seen
    # Every estimate is 3 / bpt times what it was: the fraction (estimated tokens per
    # engine KV token) with it.
    assert after["fraction"] is not None
    assert abs(after["fraction"] - FRACTION * 3 / bpt) < 1e-9, seen
