"""The prefill gate from the picker's start (`activeAtStart`) behind a real Envoy: the stack
of test_flow_prefill_gate.py (one slow-prefill server, two bands, the gate's budget between a
short and a long prompt) with a `reserve_prior` for the interactive band, which says the band
sends work. Before any interactive request has arrived, a short batch request sent while a
long one prefills is held in the picker until that prefill ends, with `activeAtStart` left
at its default; with `activeAtStart: false` the same pair is released at once
(test_flow_prefill_gate.py's first half). Why: at a burst's
start batch filled each engine's prefill queue before the first interactive request came
(bench/RESULTS.md, issue 15, activeAtStart)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from extproc.stack import Stack
from tests.e2e.test_flow_prefill_gate import BUDGET, SHORT, estimate, gate_stack, held_behind_long


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    # A window longer than the stack's start and the test: "from the start" is what is tested.
    # activeAtStart unset: its default (on, with the interactive band's prior) is tested.
    gate = {"maxPrefillTokens": BUDGET, "activeWindow": "120s"}
    prior = {10: {"request_tokens": estimate(SHORT)}}
    with gate_stack(tmp_path_factory.mktemp("flowgatestart"), gate, reserve_prior=prior) as s:
        yield s


async def test_batch_held_behind_a_long_prefill_before_any_interactive_request(stack: Stack):
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:
        await held_behind_long(stack, c, 10)
