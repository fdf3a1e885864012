"""count_engine_blocks: a request counted as its engine holds it (prompt in engine tokens plus
output, whole blocks, times the detector's kvCacheFraction), so a server of short requests,
which holds more blocks than their token counts say, is not judged to have room it lacks
(flowcontrol/engine_blocks.py; bench/trace_kvwait.py, twenty-first session). Counted so: the
top band's requests and the room every band leaves for the reserve; a lower band's request
fits by its tokens (twenty-second session), unless `engine_blocks_lower_bands`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import pytest

from extproc.core import EndpointState
from extproc.flowcontrol.controller import FlowRequest
from extproc.flowcontrol.engine_blocks import EngineBlocks
from extproc.flowcontrol.reserve import BandPrior
from tests.flowcontrol.controllers import controller, settle

FRACTION = 1.25  # estimated tokens per engine KV token
BLOCK = 16
KV_BLOCKS = 100  # 1,600 engine tokens: the detector's ceiling is 2,000 estimated tokens


def test_a_request_is_counted_in_whole_engine_blocks_times_the_fraction():
    eb = EngineBlocks(True, FRACTION)
    eb.measured({"a": 0.8, "b": 0.8, "c": 0.5}, BLOCK)  # median: 0.8 engine per estimated
    # 100 estimated prompt tokens = 80 engine + 20 output = 100, minus the never-written
    # last token: 99 -> 7 blocks = 112 engine tokens -> 140 in the detector's unit.
    assert eb.tokens(100, 20) == 140
    # Outputs counted in the estimate's unit (output_token_scale 1.25): 25 counted = 20 real.
    assert eb.tokens(100, 25, 1.25) == 140
    # A block's worth more prompt takes one more block.
    assert eb.tokens(120, 20) == round(FRACTION * 8 * BLOCK)


def test_no_block_size_counts_the_tokens_logged_once_and_counted(caplog):
    eb = EngineBlocks(True, FRACTION)
    with caplog.at_level(logging.WARNING, "extproc.flowcontrol"):
        assert eb.tokens(100, 20) == 0
        eb.measured({"a": 0.8}, None)  # a ratio but no block size yet
        assert eb.tokens(100, 20) == 0
    assert eb.unmeasured == 2 and eb.prior_counted == 0
    assert sum("block size" in r.getMessage() for r in caplog.records) == 1
    eb.measured({}, BLOCK)
    assert eb.tokens(100, 20) == 140
    off = EngineBlocks(False, FRACTION)
    off.measured({"a": 0.8}, BLOCK)
    assert off.tokens(100, 20) == 0 and off.unmeasured == 0
    # A detector whose ceiling is not the KV size: nothing to convert to.
    assert not EngineBlocks(True, 0.0).enabled


def test_before_calibration_measures_prompts_count_at_the_fractions_inverse(caplog):
    """At a burst's start a fresh picker has a block size (the first scrape) but no ratio
    (the first window, ~6 s): prompts count 1 / kvCacheFraction engine tokens per estimated
    token, not their tokens; said once and counted."""
    eb = EngineBlocks(True, 1.6)  # prior: 0.625 engine tokens per estimated token
    eb.measured({}, BLOCK)
    with caplog.at_level(logging.WARNING, "extproc.flowcontrol"):
        # 160 estimated = 100 engine + 20 output, less the last token: 119 -> 8 blocks.
        assert eb.tokens(160, 20) == round(1.6 * 8 * BLOCK)
        assert eb.tokens(160, 20) == round(1.6 * 8 * BLOCK)
    assert eb.prior_counted == 2 and eb.unmeasured == 0
    assert sum("no calibration ratio" in r.getMessage() for r in caplog.records) == 1
    eb.measured({"a": 1.0}, BLOCK)  # measured: 160 + 20 - 1 -> 12 blocks
    assert eb.tokens(160, 20) == round(1.6 * 12 * BLOCK)
    assert eb.prior_counted == 2


class Fleet:
    """Two servers of KV_BLOCKS blocks; in-flight figures as the router counts them."""

    def __init__(self) -> None:
        self.inflight = {"A": [0, 0], "B": [0, 0]}  # requests, prompt estimate tokens

    def endpoints(self) -> Sequence[tuple[str, EndpointState]]:
        size = {"kv_blocks": KV_BLOCKS, "kv_block_size": BLOCK}
        return [
            (a, EndpointState(inflight_requests=n, inflight_tokens=t, **size))
            for a, (n, t) in self.inflight.items()
        ]

    def states(self) -> Sequence[EndpointState]:
        return [s for _, s in self.endpoints()]


def detector() -> dict:
    params = {"concurrencyMode": "tokens", "outputTokens": 20, "kvCacheFraction": FRACTION}
    return {"type": "concurrency-detector", "parameters": params}


def short(eb: EngineBlocks, priority: int = 0) -> FlowRequest:
    """A short request: 100 estimated prompt tokens + 20 output; 120 by its tokens, 140 as
    its engine holds it (7 blocks)."""
    return FlowRequest("t", priority, 120, 10, output_tokens=20, engine_tokens=eb.tokens(100, 20))


async def place(ctl, fleet: Fleet, r: FlowRequest):
    ticket = await asyncio.wait_for(ctl.admit(r), 1)
    addr = ticket.target or "A"
    fleet.inflight[addr][0] += 1
    fleet.inflight[addr][1] += r.tokens - r.output_tokens
    ctl.placed(ticket, addr)
    return ticket, addr


async def fill(ctl, fleet: Fleet, eb: EngineBlocks, priority: int) -> int:
    """Short requests of one band placed as far as the room checks let them; how many."""
    placed = 0
    while placed < 40:
        task = asyncio.create_task(ctl.admit(short(eb, priority)))
        await settle()
        if not task.done():
            task.cancel()
            break
        ticket = task.result()
        fleet.inflight[ticket.target][0] += 1
        fleet.inflight[ticket.target][1] += 100
        ctl.placed(ticket, ticket.target)
        placed += 1
    return placed


@pytest.mark.parametrize(
    ("on", "priority", "lower_by_blocks", "per_server"),
    [
        # By tokens, 16 a server (1,920 of 2,000): 112 blocks of engine KV held on 100
        # blocks, the engine queues four of them.
        (False, 10, False, 16),
        # The top band by blocks: 14 a server, 98 blocks, all admitted.
        (True, 10, False, 14),
        # A lower band fits by its tokens: it may over-commit (the engine queues it) ...
        (True, 0, False, 16),
        # ... unless every band is counted by blocks.
        (True, 0, True, 14),
    ],
)
async def test_a_server_of_short_requests_is_full_by_its_blocks(
    on: bool, priority: int, lower_by_blocks: bool, per_server: int
):
    fleet = Fleet()
    ctl = controller(
        fleet, [detector()], engine_blocks=on, engine_blocks_lower_bands=lower_by_blocks
    )
    eb = EngineBlocks(on, FRACTION)
    eb.measured({"x": 0.8}, BLOCK)
    placed = await fill(ctl, fleet, eb, priority)
    assert placed == 2 * per_server
    assert fleet.inflight["A"][0] == fleet.inflight["B"][0] == per_server


@pytest.mark.parametrize(
    ("on", "lower_by_blocks", "placed", "reserve_room"),
    [
        # By tokens: 16 + 11 placed; the reserve server holds 11 x 7 = 77 blocks, room
        # for 23 x 16 x 1.25 = 460 of the 600 kept: the higher band's request waits there.
        (False, False, 27, 460),
        # Lower by tokens, the reserve by blocks: 16 over-commit one server, the other
        # takes 10 (70 blocks) and keeps 600 as its engine will hold it.
        (True, False, 26, 600),
        # Everything by blocks: 14 + 10.
        (True, True, 24, 600),
    ],
)
async def test_the_reserve_is_kept_as_the_engine_holds_it_while_lower_bands_fill_by_tokens(
    on: bool, lower_by_blocks: bool, placed: int, reserve_room: int
):
    """The twenty-first session's count by blocks cost the lower band the ~2% a server it
    filled by tokens over-committed (the engine queued it; 0.014 goodput over five pairs).
    The higher band needs its reserve's room to be there in the engine, not the lower
    band's requests to fit exactly: a lower band's request fits by its tokens, the room
    the reserve keeps is counted by blocks."""
    fleet = Fleet()
    prior = {10: BandPrior(tokens=600, prompt=580)}
    ctl = controller(
        fleet,
        [detector()],
        engine_blocks=on,
        engine_blocks_lower_bands=lower_by_blocks,
        reserve=1,
        reserve_priors=prior,
    )
    eb = EngineBlocks(on, FRACTION)
    eb.measured({"x": 0.8}, BLOCK)
    assert await fill(ctl, fleet, eb, 0) == placed
    # The most room any server has left as the engines hold it (detector's unit).
    held = {a: n * 7 * BLOCK * FRACTION for a, (n, _) in fleet.inflight.items()}
    assert max(KV_BLOCKS * BLOCK * FRACTION - h for h in held.values()) == reserve_room


async def test_other_replicas_requests_count_this_replicas_mean_difference():
    fleet = Fleet()
    ctl = controller(fleet, [detector()], engine_blocks=True)
    eb = EngineBlocks(True, FRACTION)
    eb.measured({"x": 0.8}, BLOCK)
    for _ in range(4):
        await place(ctl, fleet, short(eb))
    own_a = fleet.inflight["A"][0]
    # A peer placed 10 short requests on B: the router's figures show them (prompt
    # estimates, shared), the detector counts 100 + 20 each; this replica adds its own
    # requests' mean difference (140 - 120 = 20) for each.
    fleet.inflight["B"][0] += 10
    fleet.inflight["B"][1] += 1000
    state = dict(fleet.endpoints())["B"]
    own_b = fleet.inflight["B"][0] - 10
    counted_b = ctl._counted_at("B", 0, state, ctl._peer_extra())
    assert counted_b == own_b * 20 + 10 * 20
    assert ctl._counted_at("A", 0, dict(fleet.endpoints())["A"], ctl._peer_extra()) == own_a * 20


async def test_what_a_request_added_is_given_back_at_its_end():
    fleet = Fleet()
    ctl = controller(fleet, [detector()], engine_blocks=True)
    eb = EngineBlocks(True, FRACTION)
    eb.measured({"x": 0.8}, BLOCK)
    ticket, addr = await place(ctl, fleet, short(eb))
    assert ctl._counted_at(addr, 0, dict(fleet.endpoints())[addr], ctl._peer_extra()) == 20
    eb.measured({"x": 0.5}, BLOCK)  # the ratio moved meanwhile: the ticket keeps its count
    ctl.release(ticket)
    assert ctl._counted_at(addr, 0, dict(fleet.endpoints())[addr], ctl._peer_extra()) == 0
