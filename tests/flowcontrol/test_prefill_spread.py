"""The prefill gate's spread of the top band (`spreadTopBandTokens`,
flowcontrol/prefill_gate.py): a top-band request counts a server as having no room where the
band's unfinished prefill there plus its prompt exceeds one step's budget, while another
server is not so; with per-endpoint eviction it waits for its cut on that other server
rather than share a step."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from extproc.flowcontrol.controller import FlowController, Ticket
from extproc.flowcontrol.eviction import EvictionSettings, LowerBandEvictionFilter
from tests.flowcontrol.controllers import controller, settle, tokens_detector
from tests.flowcontrol.test_prefill_gate import Clock, Fleet, place, req

CAP = 4000  # tokens per server
STEP = 2048  # one engine step's prefill budget


@dataclass
class Setup:
    ctl: FlowController
    fleet: Fleet
    clock: Clock
    batch: dict[str, Ticket]

    @property
    def spread(self) -> int:
        assert self.ctl.gate is not None
        return self.ctl.gate.spread

    async def hi(self, prompt: int, where: str = "") -> str:
        """An interactive request admitted at once and placed (on its target by default)."""
        return place(self.ctl, self.fleet, await self.ctl.admit(req(prompt, 10)), where)

    async def tick(self, seconds: float = 0.02) -> None:
        self.clock.now += seconds
        self.ctl.tick()
        await settle()


async def setup(
    a: int, b: int, spread: int = STEP, *, evict: bool = True, claims: bool = False
) -> Setup:
    """A controller whose gate spreads by `spread`, with batch requests of these prompts
    placed on A and B (before any interactive arrival: the gate holds nothing yet)."""
    clock = Clock()
    fleet = Fleet(clock)
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
    ctl = controller(fleet, plugins, clock=clock, waiting_claims_room=claims, **extra)
    batch = {}
    for where, size in (("A", a), ("B", b)):
        if size:
            batch[where] = ticket = await ctl.admit(req(size))
            place(ctl, fleet, ticket, where)
    return Setup(ctl, fleet, clock, batch)


def gone(s: Setup, ticket: Ticket) -> None:
    """The cut request's in-flight count ends on its server."""
    s.fleet.tokens[ticket.endpoint] -= ticket.request.tokens
    s.fleet.requests[ticket.endpoint] -= 1
    s.ctl.ended(ticket)


async def test_a_close_second_prompt_waits_for_its_cut_on_the_other_server():
    s = await setup(500, 3000)  # only A has room for 1,500 more
    cut: list[str] = []
    s.batch["B"].on_evict(lambda: cut.append("B"))
    assert await s.hi(1500) == "A"
    s.clock.now += 0.05
    # A still has KV room for it, but 1,500 + 1,500 of interactive prefill there is more
    # than one step: B's batch request is cut for it instead.
    second = asyncio.create_task(s.ctl.admit(req(1500, 10)))
    await settle()
    assert not second.done() and cut == ["B"] and s.spread >= 1
    # The cut stream ends first; its in-flight count only when the gateway's access log
    # says so. Meanwhile nothing is left to cut on B, but the room is on its way: it waits.
    s.ctl.release(s.batch["B"], output_held=True)
    for _ in range(3):
        await s.tick()
    assert not second.done()
    gone(s, s.batch["B"])
    await s.tick()
    assert second.done() and second.result().endpoints == {"B"}


async def test_a_waiting_request_claims_the_server_it_waits_for_its_cut_on():
    # waiting_claims_room: the room it waits for is kept from its band's newer requests;
    # that is B's, where its cut is, not A's, where it comes closest to fitting.
    s = await setup(500, 3000, claims=True)
    await s.hi(1500, "A")
    second = asyncio.create_task(s.ctl.admit(req(1500, 10)))
    await settle()
    assert not second.done()
    assert s.ctl.claims is not None and s.ctl.claims.published() == {"B": 1500}
    second.cancel()


@pytest.mark.parametrize(
    ("batch", "first", "second", "spread"),
    [
        ((500, 3000), 1500, 1500, 0),  # off
        ((500, 3000), 1000, 1000, STEP),  # 2,000 fit one step together
        ((1800, 3000), 0, 1500, STEP),  # the gate's maxPrefillTokens bounds batch prefill
    ],
    ids=["off", "one-step", "lower-band-prefill"],
)
async def test_no_spread_where_the_step_is_not_the_top_bands(batch, first, second, spread):
    s = await setup(*batch, spread)
    if first:
        assert await s.hi(first) == "A"
    ticket = await s.ctl.admit(req(second, 10))
    assert ticket.endpoints == {"A"}
    assert s.spread == 0 and s.ctl.evict_outcomes == {"cut": 0, "short": 0}


async def test_a_finished_prefill_no_longer_crowds_its_server():
    s = await setup(500, 3000)
    first = await s.hi(1500)
    s.clock.now += 0.6
    s.fleet.scrape(**{first: 0, "B": 1})  # the first's prefill is done; B's batch is not
    assert (await s.ctl.admit(req(1500, 10))).endpoints == {"A"}
    assert s.spread == 0


async def test_with_nothing_to_cut_elsewhere_the_step_is_shared():
    # B is full of the top band itself: no cut can make room there, so the second request
    # goes where the room is rather than wait.
    s = await setup(500, 0)
    s.fleet.tokens["B"] = 3000  # another picker's interactive requests (not ours to cut)
    s.fleet.requests["B"] = 2
    await s.hi(1500, "A")
    s.clock.now += 0.05
    assert (await s.ctl.admit(req(1500, 10))).endpoints == {"A"}
    assert s.spread == 0


@pytest.mark.parametrize("spread", [STEP, 0])
async def test_without_eviction_it_spreads_among_the_servers_with_room(spread):
    # Both have room; the steer alone picks the server with the least unfinished prefill
    # (A: the interactive 1,500; B: batch 1,800 not seen to finish).
    s = await setup(0, 1800, spread, evict=False)
    await s.hi(1500, "A")
    ticket = await s.ctl.admit(req(1500, 10))
    assert ticket.endpoints == ({"B"} if spread else {"A"})
    assert s.spread == (1 if spread else 0)


async def test_every_server_crowded_spreads_nothing():
    s = await setup(0, 0)
    for where in ("A", "B"):  # (the second went to B by the spread)
        await s.hi(1500, where)
    assert s.spread == 1
    third = await s.ctl.admit(req(1500, 10))
    assert third.endpoints == {"A", "B"}
    assert s.spread == 1
