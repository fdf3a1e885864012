"""The prefill gate's spread of the top band (`spreadTopBandTokens`,
flowcontrol/prefill_gate.py): a top-band request counts a server as having no room where the
band's unfinished prefill there plus its prompt exceeds one step's budget, while another
server is not so; with per-endpoint eviction it waits for its cut on that other server
rather than share a step."""

from __future__ import annotations

import asyncio

from extproc.flowcontrol.controller import FlowController, Ticket
from extproc.flowcontrol.eviction import EvictionSettings, LowerBandEvictionFilter
from tests.flowcontrol.controllers import controller, settle, tokens_detector
from tests.flowcontrol.test_prefill_gate import Clock, Fleet, place, req

CAP = 4000  # tokens per server
STEP = 2048  # one engine step's prefill budget


def make(fleet: Fleet, clock: Clock, spread: int = STEP, *, evict: bool = True) -> FlowController:
    plugins = [
        tokens_detector(CAP),
        {"type": "prefill-gate", "parameters": {"spreadTopBandTokens": spread}},
    ]
    extra: dict[str, object] = {}
    if evict:
        extra = {
            "eviction": EvictionSettings(filter=LowerBandEvictionFilter()),
            "evict_per_endpoint": True,
        }
    return controller(fleet, plugins, clock=clock, **extra)


def finish(ctl: FlowController, fleet: Fleet, ticket: Ticket) -> None:
    fleet.tokens[ticket.endpoint] -= ticket.request.tokens
    fleet.requests[ticket.endpoint] -= 1
    ctl.release(ticket)


async def batch_on(ctl: FlowController, fleet: Fleet, a: int, b: int) -> dict[str, Ticket]:
    """Batch requests of these prompts placed on A and B (before any interactive arrival:
    the gate holds nothing yet)."""
    out = {}
    for where, size in (("A", a), ("B", b)):
        if size:
            out[where] = ticket = await ctl.admit(req(size))
            place(ctl, fleet, ticket, where)
    return out


async def test_a_close_second_prompt_waits_for_its_cut_on_the_other_server():
    clock = Clock()
    fleet = Fleet(clock)
    ctl = make(fleet, clock)
    batch = await batch_on(ctl, fleet, 500, 3000)  # only A has room for 1,500 more
    cut: list[str] = []
    batch["B"].on_evict(lambda: cut.append("B"))
    first = await ctl.admit(req(1500, priority=10))
    assert place(ctl, fleet, first) == "A"
    clock.now += 0.05
    # A still has KV room for it, but 1,500 + 1,500 of interactive prefill there is more
    # than one step: B's batch request is cut for it instead.
    second = asyncio.create_task(ctl.admit(req(1500, priority=10)))
    await settle()
    assert not second.done() and cut == ["B"]
    assert ctl.gate is not None and ctl.gate.spread >= 1
    finish(ctl, fleet, batch["B"])  # the cut stream ends
    await settle()
    assert second.done() and second.result().endpoints == {"B"}


async def test_it_waits_for_the_cut_room_until_the_cut_request_has_ended_there():
    # The cut request's stream ends first; its in-flight count only when the gateway's
    # access log says so. Meanwhile nothing is left to cut on B, but the room is coming.
    clock = Clock()
    fleet = Fleet(clock)
    ctl = make(fleet, clock)
    batch = await batch_on(ctl, fleet, 500, 3000)
    place(ctl, fleet, await ctl.admit(req(1500, priority=10)))
    clock.now += 0.05
    second = asyncio.create_task(ctl.admit(req(1500, priority=10)))
    await settle()
    ctl.release(batch["B"], output_held=True)  # the stream ended, the count not yet
    for _ in range(3):
        clock.now += 0.02
        ctl.tick()
        await settle()
    assert not second.done()
    fleet.tokens["B"] -= batch["B"].request.tokens
    fleet.requests["B"] -= 1
    ctl.ended(batch["B"])
    ctl.tick()
    await settle()
    assert second.done() and second.result().endpoints == {"B"}


async def test_without_it_the_second_prompt_shares_the_server():
    clock = Clock()
    fleet = Fleet(clock)
    ctl = make(fleet, clock, spread=0)
    await batch_on(ctl, fleet, 500, 3000)
    place(ctl, fleet, await ctl.admit(req(1500, priority=10)))
    clock.now += 0.05
    second = await ctl.admit(req(1500, priority=10))
    assert second.endpoints == {"A"}
    assert ctl.gate is not None and ctl.gate.spread == 0
    assert ctl.evict_outcomes == {"cut": 0, "short": 0}


async def test_prompts_that_fit_one_step_together_share_the_server():
    clock = Clock()
    fleet = Fleet(clock)
    ctl = make(fleet, clock)
    await batch_on(ctl, fleet, 500, 3000)
    place(ctl, fleet, await ctl.admit(req(1000, priority=10)))
    second = await ctl.admit(req(1000, priority=10))  # 2,000 <= 2,048
    assert second.endpoints == {"A"}
    assert ctl.gate is not None and ctl.gate.spread == 0


async def test_the_lower_bands_prefill_does_not_count():
    # The gate's maxPrefillTokens bounds the batch prefill an interactive request meets;
    # the spread counts only the top band's own.
    clock = Clock()
    fleet = Fleet(clock)
    ctl = make(fleet, clock)
    await batch_on(ctl, fleet, 1800, 3000)
    hi = await ctl.admit(req(1500, priority=10))
    assert hi.endpoints == {"A"}
    assert ctl.gate is not None and ctl.gate.spread == 0


async def test_a_finished_prefill_no_longer_crowds_its_server():
    clock = Clock()
    fleet = Fleet(clock)
    ctl = make(fleet, clock)
    await batch_on(ctl, fleet, 500, 3000)
    first = place(ctl, fleet, await ctl.admit(req(1500, priority=10)))
    clock.now += 0.6
    fleet.scrape(**{first: 0, "B": 1})  # the first's prefill is done; B's batch is not
    second = await ctl.admit(req(1500, priority=10))
    assert second.endpoints == {"A"}
    assert ctl.gate is not None and ctl.gate.spread == 0


async def test_with_nothing_to_cut_elsewhere_the_step_is_shared():
    # B is full of the top band itself: no cut can make room there, so the second request
    # goes where the room is rather than wait.
    clock = Clock()
    fleet = Fleet(clock)
    ctl = make(fleet, clock)
    await batch_on(ctl, fleet, 500, 0)
    fleet.tokens["B"] = 3000  # another picker's interactive requests (not ours to cut)
    fleet.requests["B"] = 2
    place(ctl, fleet, await ctl.admit(req(1500, priority=10)), "A")
    clock.now += 0.05
    second = await ctl.admit(req(1500, priority=10))
    assert second.endpoints == {"A"}
    assert ctl.gate is not None and ctl.gate.spread == 0


async def test_without_eviction_it_spreads_among_the_servers_with_room():
    clock = Clock()
    fleet = Fleet(clock)
    ctl = make(fleet, clock, evict=False)
    # Both have room; the steer alone would pick the server with the least unfinished
    # prefill (A: the interactive 1,500; B: batch 1,800 not seen to finish).
    await batch_on(ctl, fleet, 0, 1800)
    place(ctl, fleet, await ctl.admit(req(1500, priority=10)), "A")
    second = await ctl.admit(req(1500, priority=10))
    assert second.endpoints == {"B"}
    assert ctl.gate is not None and ctl.gate.spread == 1
    off = Fleet(other := Clock())
    ctl = make(off, other, spread=0, evict=False)
    await batch_on(ctl, off, 0, 1800)
    place(ctl, off, await ctl.admit(req(1500, priority=10)), "A")
    assert (await ctl.admit(req(1500, priority=10))).endpoints == {"A"}


async def test_every_server_crowded_spreads_nothing():
    clock = Clock()
    fleet = Fleet(clock)
    ctl = make(fleet, clock)
    for where in ("A", "B"):  # (the second went to B by the spread)
        place(ctl, fleet, await ctl.admit(req(1500, priority=10)), where)
    assert ctl.gate is not None and ctl.gate.spread == 1
    third = await ctl.admit(req(1500, priority=10))
    assert third.endpoints == {"A", "B"}
    assert ctl.gate.spread == 1
