"""The prefill gate from the picker's start (`activeAtStart`) behind a real Envoy: the stack
of test_flow_prefill_gate.py (one slow-prefill server, two bands, the gate's budget between a
short and a long prompt) with a `reserve_prior` for the interactive band, which says the band
sends work. Before any interactive request has arrived, a short batch request sent while a
long one prefills is held in the picker until that prefill ends; without `activeAtStart` the
same pair is released at once (test_flow_prefill_gate.py's first half). Why: at a burst's
start batch filled each engine's prefill queue before the first interactive request came
(bench/RESULTS.md, issue 15, activeAtStart)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
import yaml

from extproc.stack import Stack, StackOptions
from tests.e2e.flow_configs import metric_sum, queued, two_band_reserve_config
from tests.e2e.test_flow_prefill_gate import LONG, PREFILL_TPS, SHORT, estimate, long_and_short


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("flowgatestart")
    path = two_band_reserve_config(
        tmp,
        "queue-scorer",
        1_000_000,  # KV room never holds anything here
        reserve_for_higher_bands=0,
        expected_output_tokens=0,
        reserve_prior={10: {"request_tokens": estimate(SHORT)}},
    )
    cfg = yaml.safe_load(path.read_text())
    budget = (estimate(SHORT) + estimate(LONG + SHORT)) // 2
    # A window longer than the stack's start and the test: "from the start" is what is tested.
    params = {"maxPrefillTokens": budget, "activeAtStart": True, "activeWindow": "120s"}
    cfg["scheduling"]["plugins"].append({"type": "prefill-gate", "parameters": params})
    path.write_text(yaml.safe_dump(cfg))
    sim = ("--prefill-tps", str(PREFILL_TPS), "--decode-tps", "100")
    with Stack(StackOptions(upstreams=1, sim_args=sim, extproc_args=("--config", str(path)))) as s:
        yield s


async def test_batch_held_behind_a_long_prefill_before_any_interactive_request(stack: Stack):
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:
        watch = asyncio.create_task(long_and_short(stack, c, 10))
        seen_queued = False
        while not watch.done():
            seen_queued |= await asyncio.to_thread(queued, stack, 0) == 1
            await asyncio.sleep(0.05)
        short_s, long_ttft = await watch
    assert long_ttft > 1.0, "the long prefill was too short to tell"
    assert short_s > long_ttft, "released while the long prefill ran: the gate was off"
    assert seen_queued, "never seen in the picker's queue"
    assert metric_sum(stack, r"^extproc_flow_prefill_gate_held_total (\S+)$") >= 1
