"""The reserve sized from a quantile of the higher band's recent requests
(`flow_control.reserve_quantile: 0.9`), behind a real Envoy: `extproc serve` with
per-endpoint admission, `reserve_for_higher_bands: 1`, a token-mode concurrency detector,
two simulated vLLM servers.

Interactive (10) has sent 18 small requests and 2 large ones. Sized by the largest, the
reserve is a large request's room, which no server holds beside a batch request: the
second batch request must go beside the first so the idle server stays free. Sized by the
p90 (a small request) the idle server keeps that room with a batch request on it, so the
second batch request goes there (the scorer's choice, the less loaded server), and a small
interactive request is still answered at once while both batch requests stream."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from extproc.flowcontrol.reserve import QUANTILE_TRUSTED
from extproc.stack import Stack
from tests.e2e.flow_configs import (
    HI,
    LO,
    metric_sum,
    reserve_body,
    reserve_estimate,
    reserve_stack,
    start_streaming,
)
from tests.e2e.sim_speed import finish_fast

TINY, SMALL, BIG = 20, 150, 500  # words of 7 letters: ~40, ~300 and ~1000 estimated tokens
LONG = 500  # output tokens at 100 tokens/s: ~5 s of streaming


# Two batch requests fit on one server; a batch and a large interactive request do not; a
# batch and a small interactive one do.
CAP = 2 * reserve_estimate(SMALL) + 100


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    assert (
        reserve_estimate(SMALL) + reserve_estimate(BIG)
        > CAP
        >= reserve_estimate(SMALL) + reserve_estimate(TINY)
    )
    with reserve_stack(tmp_path_factory.mktemp("flowquantile"), CAP, reserve_quantile=0.9) as s:
        yield s


async def test_batch_work_keeps_only_the_interactive_p90s_room(stack: Stack):
    model = stack.fleet.model
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:
        # Interactive's history: 2 large requests among 18 small ones (one at a time).
        for i in range(QUANTILE_TRUSTED):
            words = BIG if i in (4, 12) else TINY
            req = reserve_body(model, 100 + i, words, 1)
            r = await c.post("/v1/chat/completions", json=req, headers=HI)
            assert r.status_code == 200
        first, busy = await start_streaming(c, model, 1, SMALL, LONG, LO)
        second, there = await start_streaming(c, model, 2, SMALL, LONG, LO)
        # Sized by the largest (1,000 tokens) it would have gone beside the first.
        assert there != busy, "kept room for the largest"
        reserved = metric_sum(stack, r"^extproc_flow_reserved_tokens (\S+)$")
        assert reserve_estimate(TINY) <= reserved < reserve_estimate(BIG)
        hist = r'^extproc_flow_reserve_history_requests{priority="10"} (\S+)$'
        assert metric_sum(stack, hist) == QUANTILE_TRUSTED
        # A small interactive request finds the room kept: answered while both stream.
        hi = await c.post("/v1/chat/completions", json=reserve_body(model, 3, TINY, 4), headers=HI)
        assert hi.status_code == 200
        assert not first.done() and not second.done(), "a batch request ended before"
        finish_fast(stack.fleet)  # checked: they end now, not seconds later
        assert await first == 200 and await second == 200
    assert metric_sum(stack, r"^extproc_flow_reserve_held_total (\S+)$") == 0
