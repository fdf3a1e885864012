"""The reserve for higher bands less the room a server is about to free
(`flow_control.reserve_refill_s`), behind a real Envoy: `extproc serve` with per-endpoint
admission and `reserve_for_higher_bands: 1`, two bands (interactive 10, batch 0), a
token-mode concurrency detector, two simulated vLLM servers.

Interactive's largest request sets the reserve. A long batch request streams on one server
and short batch requests come and go on the other; then a long interactive request streams
there. Neither server has the reserve's room free now (each is short of it by a little), but
the second has been freeing room at a rate that makes up for it within the horizon: a short
batch request is answered while both long ones still stream (before: held until one ended).
Once the short ones' ends are out of the window, the next short batch request is held.

With a floor under the credit (`flow_control.reserve_refill_floor`): the same credit, but the
server keeps 0.95 of the reserve whatever it is, more than either has free, so the same short
batch request is held until the long ones end."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from extproc.flowcontrol.refill import WINDOW_S
from extproc.sim import SERVED_BY_HEADER
from extproc.stack import Stack
from tests.e2e.flow_configs import (
    HI,
    LO,
    held_or_done,
    metric_sum,
    reserve_body,
    reserve_estimate,
    reserve_stack,
    start_streaming,
)
from tests.e2e.sim_speed import finish_fast

SMALL, MEDIUM, BIG = 150, 250, 500  # words of 7 letters: ~300, ~500, ~1000 tokens
LONG = 2000  # output tokens at 100 tokens/s: ~20 s of streaming
SHORT = 100  # each server is short of the reserve by this much
REFILL_S = 1.0
ENDS = 6  # short requests ended on the second server: ~1,800 tokens, a credit of ~600
CAP = reserve_estimate(MEDIUM) + reserve_estimate(BIG) - SHORT
# Kept with the floor: 0.95 of the ~1,000 reserve, over the ~900 each server has free (the
# reserve less SHORT), whatever either's credit (the first server's: the largest request's
# end). Without it the second server's credit (~600) leaves ~400 kept there, room for a
# SMALL request besides.
FLOOR = 0.95


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("flowrefill")
    with reserve_stack(tmp, CAP, reserve_refill_s=REFILL_S) as s:
        yield s


@pytest.fixture(scope="module")
def floored(tmp_path_factory) -> Iterator[Stack]:
    # The same, with a floor under the credit: each server keeps at least FLOOR of the
    # reserve, more than it has free.
    tmp = tmp_path_factory.mktemp("flowrefillfloor")
    with reserve_stack(tmp, CAP, reserve_refill_s=REFILL_S, reserve_refill_floor=FLOOR) as s:
        yield s


async def lending(
    stack: Stack, c: httpx.AsyncClient
) -> tuple[asyncio.Task[int], asyncio.Task[int], str]:
    """The scenario up to the credit: interactive's largest request (the reserve), a long
    batch request streaming on one server, ENDS short ones ended on the other, then a long
    interactive request streaming there. Returns the two long ones and the batch one's
    server."""
    model = stack.fleet.model
    big = await c.post("/v1/chat/completions", json=reserve_body(model, 100, BIG, 1), headers=HI)
    assert big.status_code == 200
    batch, lo_server = await start_streaming(c, model, 200, MEDIUM, LONG, LO)
    # Short batch requests, one at a time, on the other (less loaded) server; each once the
    # last has ended there (its in-flight count ends with its access-log entry: until then
    # the reserve keeps the next one off that server).
    for i in range(ENDS):
        req = reserve_body(model, 300 + i, SMALL, 1)
        r = await c.post("/v1/chat/completions", json=req, headers=LO)
        assert r.status_code == 200 and r.headers[SERVED_BY_HEADER] != lo_server
        other = r.headers[SERVED_BY_HEADER]
        for _ in range(100):
            left = await asyncio.to_thread(
                metric_sum, stack, rf'^extproc_inflight_tokens{{endpoint="{other}"}} (\S+)$',
                present=False,
            )  # fmt: skip
            if not left:
                break
            await asyncio.sleep(0.02)
    interactive, hi_server = await start_streaming(c, model, 201, MEDIUM, LONG, HI)
    assert hi_server != lo_server
    return batch, interactive, lo_server


async def test_a_server_freeing_room_keeps_less_of_the_reserve(stack: Stack):
    model = stack.fleet.model
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:
        batch, interactive, _ = await lending(stack, c)
        # Each server has the reserve less SHORT free; the second frees room soon.
        short = await c.post(
            "/v1/chat/completions", json=reserve_body(model, 400, SMALL, 4), headers=LO
        )
        assert short.status_code == 200
        assert not batch.done() and not interactive.done(), "a long request ended too soon"
        assert metric_sum(stack, r"^extproc_flow_reserve_refill_tokens (\S+)$") > SHORT
        assert metric_sum(stack, r"^extproc_flow_reserved_tokens (\S+)$") >= reserve_estimate(BIG)
        # Out of the window, nothing ended there recently: held again.
        await asyncio.sleep(WINDOW_S + 0.5)
        late = asyncio.create_task(
            c.post("/v1/chat/completions", json=reserve_body(model, 401, SMALL, 4), headers=LO)
        )
        await held_or_done(stack, late)
        assert not late.done(), "released with no room freed recently"
        assert not batch.done() and not interactive.done(), "a long request ended too soon"
        # The long ones end now instead of streaming on for another ~15 s; their ends free
        # the room that releases the late one.
        finish_fast(stack.fleet)
        assert await batch == 200 and await interactive == 200
        assert (await late).status_code == 200  # released once room came back


async def test_the_floor_keeps_what_the_credit_would_lend(floored: Stack):
    model = floored.fleet.model
    async with httpx.AsyncClient(base_url=floored.url, timeout=60) as c:
        batch, interactive, _ = await lending(floored, c)
        # The same short batch request, the same credit (enough to let it in, as the test
        # above is); every server keeps FLOOR of the reserve, more than it has free: held.
        short = asyncio.create_task(
            c.post("/v1/chat/completions", json=reserve_body(model, 400, SMALL, 4), headers=LO)
        )
        await held_or_done(floored, short)
        assert not short.done(), "let in on the credit below the floor"
        credit = metric_sum(floored, r"^extproc_flow_reserve_refill_tokens (\S+)$")
        assert credit >= SHORT + reserve_estimate(SMALL), "no credit to lend: nothing tested"
        assert not batch.done() and not interactive.done(), "a long request ended too soon"
        finish_fast(floored.fleet)
        assert await batch == 200 and await interactive == 200
        assert (await short).status_code == 200  # released once room came back
