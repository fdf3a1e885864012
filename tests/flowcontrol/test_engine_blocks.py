"""count_engine_blocks: a request counted as its engine holds it (prompt in engine tokens plus
output, whole blocks, times the detector's kvCacheFraction), so a server of short requests,
which holds more blocks than their token counts say, is not judged to have room it lacks
(flowcontrol/engine_blocks.py; bench/trace_kvwait.py, twenty-first session)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import pytest

from extproc.core import EndpointState
from extproc.flowcontrol.controller import FlowRequest
from extproc.flowcontrol.engine_blocks import EngineBlocks
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


def test_unmeasured_counts_the_tokens_logged_once_and_counted(caplog):
    eb = EngineBlocks(True, FRACTION)
    with caplog.at_level(logging.WARNING, "extproc.flowcontrol"):
        assert eb.tokens(100, 20) == 0
        eb.measured({"a": 0.8}, None)  # a ratio but no block size yet
        assert eb.tokens(100, 20) == 0
    assert eb.unmeasured == 2
    assert sum("count_engine_blocks" in r.getMessage() for r in caplog.records) == 1
    eb.measured({}, BLOCK)
    assert eb.tokens(100, 20) == 140
    off = EngineBlocks(False, FRACTION)
    off.measured({"a": 0.8}, BLOCK)
    assert off.tokens(100, 20) == 0 and off.unmeasured == 0
    # A detector whose ceiling is not the KV size: nothing to convert to.
    assert not EngineBlocks(True, 0.0).enabled


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


@pytest.mark.parametrize("on", [False, True])
async def test_a_server_of_short_requests_is_full_by_its_blocks(on: bool):
    fleet = Fleet()
    ctl = controller(fleet, [detector()], engine_blocks=on)
    eb = EngineBlocks(on, FRACTION)
    eb.measured({"x": 0.8}, BLOCK)
    # Fill both servers with short requests as far as the room check lets them.
    placed = 0
    while placed < 40:
        task = asyncio.create_task(ctl.admit(short(eb)))
        await settle()
        if not task.done():
            task.cancel()
            break
        ticket = task.result()
        fleet.inflight[ticket.target][0] += 1
        fleet.inflight[ticket.target][1] += 100
        ctl.placed(ticket, ticket.target)
        placed += 1
    # By tokens, 16 a server (1,920 of 2,000): 112 blocks of engine KV held on 100 blocks,
    # the engine queues four of them. By blocks, 14 a server: 98 blocks, all admitted.
    per_server = 14 if on else 16
    assert placed == 2 * per_server
    assert fleet.inflight["A"][0] == fleet.inflight["B"][0] == per_server


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
