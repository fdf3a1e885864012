"""The reserve for a higher band grows with that band's arrival rate, behind a real Envoy:
`extproc serve` with per-endpoint admission and `reserve_for_higher_bands: 1`, two bands
(interactive 10, batch 0), a token-mode concurrency detector, two simulated vLLM servers.

Interactive traffic arrives fast (a burst of requests, then a large one), so while its
largest request prefills more interactive work is expected: the room kept for it is that
request plus the arrival rate times its prefill time (at the fastest measured prefill
speed), not the request alone. With a long batch request on one server and a long
interactive one on the other, a short batch request fits beside the batch one and leaves
the interactive server room for the largest interactive request, but not for that plus
what arrives meanwhile: it is held (before: released at once)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from extproc.stack import Stack
from tests.e2e.flow_configs import (
    HI,
    LO,
    burst_then_large,
    held_or_done,
    metric_sum,
    queued,
    reserve_body,
    reserve_estimate,
    reserve_stack,
    start_streaming,
)
from tests.e2e.sim_speed import finish_fast

SMALL, MEDIUM, BIG = 150, 250, 500  # words of 7 letters: ~300, ~500, ~1000 tokens
LONG = 600  # output tokens at 100 tokens/s: ~6 s of streaming
MARGIN = 150  # the rate term must add more than this (it adds ~300-1500 here)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    # The interactive server holds MEDIUM; beside it the old reserve (the largest
    # interactive request, BIG) fits with MARGIN to spare, the new one does not.
    cap = reserve_estimate(MEDIUM) + reserve_estimate(BIG) + MARGIN
    # A slower prefill than the default, so a prefill time is long next to the client's
    # own overheads (the rate term is arrival rate x prefill time).
    sim = ("--decode-tps", "100", "--prefill-tps", "4000")
    with reserve_stack(tmp_path_factory.mktemp("flowrate"), cap, sim) as s:
        yield s


async def test_batch_leaves_room_for_the_interactive_work_expected_meanwhile(stack: Stack):
    model = stack.fleet.model
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:
        # Interactive history: a burst of small requests, then the large one. Streamed, as
        # interactive traffic is: the sim (as vLLM) sends its headers before the prefill, so
        # time to first byte says nothing of the prefill; the speed must be the engines' own
        # (from their histograms). Sized by time to first byte, the rate term was ~0 here.
        smalls = [reserve_body(model, i, SMALL, 1) for i in range(8)]
        await burst_then_large(stack, c, smalls, reserve_body(model, 100, BIG, 1))
        batch, lo_server = await start_streaming(c, model, 200, MEDIUM, LONG, LO)
        interactive, hi_server = await start_streaming(c, model, 201, MEDIUM, LONG, HI)
        assert hi_server != lo_server  # the less loaded one

        short = asyncio.create_task(
            c.post("/v1/chat/completions", json=reserve_body(model, 300, SMALL, 4), headers=LO)
        )
        await held_or_done(stack, short)
        # Before: released beside the batch request (the interactive server kept room for
        # the largest interactive request). Now: that room is not enough.
        assert not short.done(), "the short batch request was released"
        assert not batch.done() and not interactive.done(), "a long request ended too soon"
        held = metric_sum(stack, r"^extproc_flow_reserved_tokens (\S+)$")
        assert held > reserve_estimate(BIG) + MARGIN
        assert metric_sum(stack, r"^extproc_flow_reserve_rate_unsized_total (\S+)$") == 0
        finish_fast(stack.fleet)  # checked: the long ones end now, not seconds later
        assert await batch == 200 and await interactive == 200
        assert (await short).status_code == 200  # released once room came back
        assert queued(stack, priority=0) == 0
