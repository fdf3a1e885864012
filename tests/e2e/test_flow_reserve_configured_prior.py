"""A configured reserve prior keeps room for a higher band's large requests before that band
has sent anything, behind a real Envoy: `extproc serve` with per-endpoint admission,
`reserve_for_higher_bands: 1` and `reserve_prior` for interactive (10), a token-mode
concurrency detector, two simulated vLLM servers, a freshly started picker.

At a burst's start lower work arrives first. Without a prior the picker reserves the room
of the largest request it has seen (a batch one, small), so the second batch request goes
to the idle server and a large interactive request then finds no server with room: it
waited in the picker until a batch request ended (the overload bench's worst interactive
waits, 0.7-1.2 s, were these). With the prior the idle server is kept for the interactive
size configured, the second batch request goes beside the first, and the interactive one
is answered on the server kept free while both batch requests still stream."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from extproc.sim import SERVED_BY_HEADER
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

SMALL, BIG = 150, 500  # words of 7 letters: ~300 and ~1000 estimated tokens
LONG = 500  # output tokens at 100 tokens/s: ~5 s of streaming


# Two batch requests fit on one server; one batch and one interactive request do not.
CAP = 2 * reserve_estimate(SMALL) + 100


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    assert reserve_estimate(SMALL) + reserve_estimate(BIG) > CAP
    prior = {10: {"request_tokens": reserve_estimate(BIG)}}
    with reserve_stack(tmp_path_factory.mktemp("flowconfprior"), CAP, reserve_prior=prior) as s:
        yield s


async def test_a_fresh_picker_keeps_a_server_for_the_configured_interactive_size(stack: Stack):
    model = stack.fleet.model
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:
        first, busy = await start_streaming(c, model, 1, SMALL, LONG, LO)
        second, there = await start_streaming(c, model, 2, SMALL, LONG, LO)
        # Before: on the idle server (the reserve was one small batch request's room).
        assert there == busy, "batch took the server kept free"
        assert metric_sum(stack, r'^extproc_flow_reserve_on_prior{priority="10"} (\S+)$') == 1
        assert metric_sum(stack, r"^extproc_flow_reserved_tokens (\S+)$") >= reserve_estimate(BIG)
        hi = await c.post("/v1/chat/completions", json=reserve_body(model, 3, BIG, 4), headers=HI)
        assert hi.status_code == 200
        assert hi.headers[SERVED_BY_HEADER] != busy
        # Answered while both batch requests still stream: it did not wait for one to end.
        assert not first.done() and not second.done(), "a batch request ended before"
        finish_fast(stack.fleet)  # checked: they end now, not seconds later
        assert await first == 200 and await second == 200
    hist = r'^extproc_flow_reserve_history_requests{priority="10"} (\S+)$'
    assert metric_sum(stack, hist) == 1


RATE, PREFILL_S = 2000.0, 0.25  # the prior's arrival rate and its largest prefill's time


@pytest.fixture(scope="module")
def stack_pf(tmp_path_factory) -> Iterator[Stack]:
    prior = {
        10: {"request_tokens": reserve_estimate(BIG), "tokens_per_s": RATE, "prefill_s": PREFILL_S}
    }
    with reserve_stack(tmp_path_factory.mktemp("flowconfpriorpf"), CAP, reserve_prior=prior) as s:
        yield s


async def test_the_priors_prefill_time_prices_the_rate_term_before_any_speed(stack_pf: Stack):
    # A fresh picker has measured no prefill speed (nothing has been prefilled): the
    # prior's prefill time prices the rate term. Before: the largest request alone, and
    # the rate counted as unsized.
    model = stack_pf.fleet.model
    async with httpx.AsyncClient(base_url=stack_pf.url, timeout=60) as c:
        r = await c.post("/v1/chat/completions", json=reserve_body(model, 9, SMALL, 1), headers=LO)
        assert r.status_code == 200
    reserved = metric_sum(stack_pf, r"^extproc_flow_reserved_tokens (\S+)$")
    assert reserved == reserve_estimate(BIG) + int(RATE * PREFILL_S)
    assert metric_sum(stack_pf, r"^extproc_flow_reserve_rate_unsized_total (\S+)$") == 0
