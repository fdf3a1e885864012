"""The joint spike quantile (`flow_control.reserve_spike_joint`), behind a real Envoy:
`extproc serve` with per-endpoint admission, `reserve_for_higher_bands: 1`, the spike term
(`reserve_spike_s`, `reserve_spike_quantile: 0.95`), a token-mode concurrency detector and
two simulated vLLM servers.

Interactive (10) has sent one large request, then 19 tiny ones, one at a time and all
within one spike window (the window is far longer than the history takes, so every request's
clump is everything before it, however slow the machine). Added, the spike term is the 0.95
quantile of what came before each (the large one and 17 tiny ones) on top of the largest
request: the large request counted twice. Joint, it is the 0.95 quantile of each request's
clump with its own tokens (the large one and 18 tiny ones): the large request once. The
reserved gauge says which, exactly; and with the joint reserve the idle server keeps it
beside one batch request, so the second batch request goes there (the scorer's choice, the
less loaded server) where, added, it had to go beside the first."""

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

TINY, BATCH, BIG = 20, 300, 500  # words of 7 letters: ~40, ~600 and ~1000 estimated tokens
LONG = 500  # the batch requests' output at 100 tokens/s: ~5 s of streaming
QUANTILE = 0.95
WINDOW_S = 10.0  # reserve_spike_s (its largest): the whole history is one clump
# The 0.95 quantile of 20 clumps is the 19th smallest (nearest rank): the clump ending at
# the 19th request, counted with it (joint) or before it (added).
JOINT = reserve_estimate(BIG) + 18 * reserve_estimate(TINY)
ADDED = reserve_estimate(BIG) + (reserve_estimate(BIG) + 17 * reserve_estimate(TINY))
# A server holds two batch requests; one whole server holds the added reserve, one beside a
# batch request does not, but holds the joint one.
CAP = ADDED + reserve_estimate(BATCH) // 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    batch = reserve_estimate(BATCH)
    assert 2 * batch <= CAP and JOINT <= CAP - batch < ADDED <= CAP
    flow = {
        "reserve_spike_s": WINDOW_S,
        "reserve_spike_quantile": QUANTILE,
        "reserve_spike_joint": True,
    }
    with reserve_stack(tmp_path_factory.mktemp("flowspikejoint"), CAP, **flow) as s:
        yield s


async def test_batch_work_keeps_the_joint_clump_quantiles_room(stack: Stack):
    await joint_room_kept(stack)


async def joint_room_kept(stack: Stack) -> None:
    """The history above, then two batch requests: the reserved gauge reads the joint value
    and the second batch request goes to the idle server (also test_flow_spike_auto.py)."""
    model = stack.fleet.model
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:
        # Interactive's history: the large request first, then tiny ones (one at a time, so
        # the picker notes them in this order).
        for i in range(QUANTILE_TRUSTED):
            req = reserve_body(model, 100 + i, BIG if i == 0 else TINY, 1)
            r = await c.post("/v1/chat/completions", json=req, headers=HI)
            assert r.status_code == 200
        first, busy = await start_streaming(c, model, 1, BATCH, LONG, LO)
        reserved = metric_sum(stack, r"^extproc_flow_reserved_tokens (\S+)$")
        assert reserved == JOINT, f"reserved {reserved:.0f}: joint {JOINT}, added {ADDED}"
        hist = r'^extproc_flow_reserve_history_requests{priority="10"} (\S+)$'
        assert metric_sum(stack, hist) == QUANTILE_TRUSTED
        spike = r'^extproc_flow_reserve_spike_arrivals{priority="10"} (\S+)$'
        assert metric_sum(stack, spike) == QUANTILE_TRUSTED  # the spike term counts
        second, there = await start_streaming(c, model, 2, BATCH, LONG, LO)
        # Sized as added (the large request twice) it would have gone beside the first.
        assert there != busy, "kept room for the added term"
        assert metric_sum(stack, r"^extproc_flow_reserved_tokens (\S+)$") == JOINT
        finish_fast(stack.fleet)
        assert await first == 200 and await second == 200
