"""The prefill gate after an interactive silence (`stayActive`) behind a real Envoy: the stack
of test_flow_prefill_gate.py with a `reserve_prior` for the interactive band and a short
`activeWindow`. An interactive request, then a silence past the window: a short batch request
sent while a long one prefills is still held in the picker until that prefill ends. Without
`stayActive` the window has run out and the pair is released at once (the first half of
test_flow_prefill_gate.py). Why: after an interactive pause longer than the window, batch
filled each engine's prefill queue and the first interactive requests after it waited behind
it (bench/RESULTS.md, issue 15, stayActive)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from extproc.stack import Stack
from tests.e2e.test_flow_prefill_gate import (
    BUDGET,
    HI,
    SHORT,
    body,
    estimate,
    gate_stack,
    held_behind_long,
)

WINDOW_S = 1.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    gate = {"maxPrefillTokens": BUDGET, "activeWindow": f"{WINDOW_S:g}s", "stayActive": True}
    prior = {10: {"request_tokens": estimate(SHORT)}}
    with gate_stack(tmp_path_factory.mktemp("flowgatestay"), gate, reserve_prior=prior) as s:
        yield s


async def test_batch_held_behind_a_long_prefill_after_an_interactive_silence(stack: Stack):
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:
        hi = await c.post(
            "/v1/chat/completions", json=body(stack.fleet.model, 50, SHORT), headers=HI
        )
        assert hi.status_code == 200
        await asyncio.sleep(WINDOW_S * 1.5)  # silence past the window
        await held_behind_long(stack, c, 20)
