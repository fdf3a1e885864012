"""The reserve's arrival-rate term over a typical prompt's prefill
(`flow_control.reserve_rate_quantile: 0.5`), behind a real Envoy: `extproc serve` with
per-endpoint admission and `reserve_for_higher_bands: 1`, two bands (interactive 10,
batch 0), a token-mode concurrency detector, two simulated vLLM servers.

The setup of tests/e2e/test_flow_reserve_rate.py: interactive traffic arrives fast (a
burst of tiny and medium requests, then a large one), a long batch request on one server
and a long interactive one on the other, then a short batch request that fits beside
either only if the other server need keep no more than the largest interactive request
plus a little. Counted over the largest request's prefill, the rate term is more than
that little and the short request is held (as in that test); counted over the median
prompt's prefill (a tiny one) it is not, and the short request is answered while both
long ones still stream. The largest request's own room is still kept."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from extproc.flowcontrol.reserve import QUANTILE_TRUSTED
from extproc.stack import Stack
from tests.e2e.flow_configs import (
    HI,
    LO,
    burst_then_large,
    metric_sum,
    reserve_body,
    reserve_estimate,
    reserve_stack,
    start_streaming,
)
from tests.e2e.sim_speed import finish_fast

TINY, SMALL, MEDIUM, BIG = 20, 150, 250, 500  # words of 7 letters: ~40 ... ~1000 tokens
LONG = 600  # output tokens at 100 tokens/s: ~6 s of streaming
MARGIN = 60  # the rate term adds ~200 over the largest's prefill here, ~10 over a tiny one's


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    cap = reserve_estimate(MEDIUM) + reserve_estimate(BIG) + MARGIN
    sim = ("--decode-tps", "100", "--prefill-tps", "4000")
    tmp = tmp_path_factory.mktemp("flowratequantile")
    with reserve_stack(tmp, cap, sim, reserve_rate_quantile=0.5) as s:
        yield s


async def test_the_rate_term_counts_a_median_prefill_not_the_largest(stack: Stack):
    model = stack.fleet.model
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:
        # Interactive history: 11 tiny and 8 medium requests at once, then the large one:
        # the median prompt is a tiny one (with the long interactive request below too),
        # while the medium ones make the arrival rate.
        n = QUANTILE_TRUSTED // 2 + 1
        burst = [
            reserve_body(model, i, TINY if i < n else MEDIUM, 1)
            for i in range(QUANTILE_TRUSTED - 1)
        ]
        await burst_then_large(stack, c, burst, reserve_body(model, 100, BIG, 1))
        batch, lo_server = await start_streaming(c, model, 200, MEDIUM, LONG, LO)
        interactive, hi_server = await start_streaming(c, model, 201, MEDIUM, LONG, HI)
        assert hi_server != lo_server

        short = await c.post(
            "/v1/chat/completions", json=reserve_body(model, 300, SMALL, 4), headers=LO
        )
        assert short.status_code == 200
        # Answered while both long requests stream: it was not held for the rate term.
        assert not batch.done() and not interactive.done(), "a long request ended too soon"
        held = metric_sum(stack, r"^extproc_flow_reserved_tokens (\S+)$")
        assert reserve_estimate(BIG) <= held <= reserve_estimate(BIG) + MARGIN
        assert metric_sum(stack, r"^extproc_flow_reserve_rate_unsized_total (\S+)$") == 0
        finish_fast(stack.fleet)  # checked: the long ones end now, not seconds later
        assert await batch == 200 and await interactive == 200
