"""The prefill gate (flowcontrol/prefill_gate.py): while a higher band is active, a lower
band's request starts only where the server's unfinished prefill stays under the gate's
budget (the engine's count of requests before their first token retires this picker's
placements), and a higher band's request goes where the least prefill is unfinished."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import pytest

from extproc.core import EndpointState
from extproc.errors import ConfigError
from extproc.flowcontrol.config import build_flow_config
from extproc.flowcontrol.controller import FlowController, FlowRequest, Ticket
from extproc.flowcontrol.reserve import BandPrior
from tests.flowcontrol.controllers import controller, settle, tokens_detector

CAP = 100_000  # KV room is never what holds a request here


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Fleet:
    """Two servers as a fresh scrape shows them: requests before their first token
    (`prefilling`, None: not exported) and in-flight prompt tokens."""

    def __init__(self, clock: Clock) -> None:
        self.prefilling: dict[str, int | None] = {"A": 0, "B": 0}
        self.tokens = {"A": 0, "B": 0}
        self.requests = {"A": 0, "B": 0}
        self.clock = clock
        self.scraped_at = clock.now - 0.05  # before anything was placed

    def scrape(self, **prefilling: int | None) -> None:
        """A scrape now, showing these counts."""
        self.scraped_at = self.clock.now
        self.prefilling.update(prefilling)

    def endpoints(self) -> Sequence[tuple[str, EndpointState]]:
        return [
            (
                a,
                EndpointState(
                    inflight_requests=self.requests[a],
                    inflight_tokens=self.tokens[a],
                    age_s=self.clock.now - self.scraped_at,
                    is_stale=False,
                    prefilling=self.prefilling[a],
                ),
            )
            for a in ("A", "B")
        ]

    def states(self) -> Sequence[EndpointState]:
        return [s for _, s in self.endpoints()]


def make(
    fleet: Fleet, clock: Clock, params: dict | None = None, *, gate: bool = True
) -> FlowController:
    plugins = [tokens_detector(CAP)]
    if gate:
        plugins.append({"type": "prefill-gate", "parameters": params or {}})
    return controller(fleet, plugins, clock=clock)


def req(prompt: int, priority: int = 0) -> FlowRequest:
    return FlowRequest("t", priority, prompt + 10, 10, output_tokens=10)


def place(ctl: FlowController, fleet: Fleet, ticket: Ticket, where: str = "") -> str:
    """What the router does: count it in flight where it went (its target by default)."""
    where = where or ticket.target
    fleet.tokens[where] += ticket.request.tokens
    fleet.requests[where] += 1
    ctl.placed(ticket, where)
    return where


async def test_batch_held_while_interactive_is_active_and_released_as_prefill_ends():
    clock = Clock()
    fleet = Fleet(clock)
    ctl = make(fleet, clock, {"maxPrefillTokens": 1000})
    hi = await ctl.admit(req(100, priority=10))  # interactive is active from now
    ctl.release(hi)  # (never placed: not counted anywhere)
    first = await ctl.admit(req(800))  # nothing unfinished anywhere
    a = place(ctl, fleet, first)
    clock.now += 0.01
    second = await ctl.admit(req(800))  # 800 + 800 > 1000 where the first is
    b = place(ctl, fleet, second)
    assert b != a
    clock.now += 0.01
    third = asyncio.create_task(ctl.admit(req(800)))
    await settle()
    assert not third.done() and ctl.gate is not None and ctl.gate.held >= 1
    assert ctl.gate.last_unfinished == {"A": 800, "B": 800}
    # A scrape after both reached the engines: `a` still prefills (1), `b` is done (0).
    clock.now += 0.6
    fleet.scrape(**{a: 1, b: 0})
    ctl.tick()
    await settle()
    assert third.done()
    assert third.result().endpoints == {b}
    assert ctl.gate.last_unfinished[a] == 800


async def test_a_server_with_nothing_unfinished_takes_a_request_above_the_budget():
    clock = Clock()
    fleet = Fleet(clock)
    ctl = make(fleet, clock, {"maxPrefillTokens": 500})
    ctl.release(await ctl.admit(req(100, priority=10)))
    ticket = await ctl.admit(req(2000))
    assert ticket.endpoints == {"A", "B"}


async def test_no_hold_without_a_higher_band_within_the_window():
    clock = Clock()
    fleet = Fleet(clock)
    ctl = make(fleet, clock, {"maxPrefillTokens": 1000, "activeWindow": "5s"})
    for _ in range(3):  # batch alone: never held
        place(ctl, fleet, await ctl.admit(req(800)))
    ctl.release(await ctl.admit(req(100, priority=10)))
    clock.now += 5.5  # the interactive arrival is out of the window again
    place(ctl, fleet, await ctl.admit(req(800)))
    assert ctl.gate is not None and ctl.gate.held == 0
    # Within it, the same request is held (both servers hold unseen prefill).
    ctl.release(await ctl.admit(req(100, priority=10)))
    held = asyncio.create_task(ctl.admit(req(800)))
    await settle()
    assert not held.done() and ctl.gate.held >= 1
    held.cancel()


PRIOR = {10: BandPrior(tokens=1000, prompt=900, rate=500.0)}


@pytest.mark.parametrize("at_start", [True, None], ids=["set", "default"])
async def test_active_at_start_holds_batch_before_the_first_interactive_arrival(at_start):
    # The burst's first second (bench/RESULTS.md, issue 15, activeAtStart): batch placed
    # before interactive had arrived once was never gated; with a band's prior it is now,
    # by default.
    clock = Clock()
    fleet = Fleet(clock)
    params = {"maxPrefillTokens": 1000, "activeWindow": "5s"}
    if at_start is not None:
        params["activeAtStart"] = at_start
    ctl = make_with(fleet, clock, params, reserve_priors=PRIOR)
    a = place(ctl, fleet, await ctl.admit(req(800)))
    b = place(ctl, fleet, await ctl.admit(req(800)))  # one on each server
    assert {a, b} == {"A", "B"}
    held = asyncio.create_task(ctl.admit(req(800)))
    await settle()
    assert not held.done() and ctl.gate is not None and ctl.gate.held >= 1
    # One window after the start with no interactive arrival: batch runs at full speed.
    clock.now += 5.5
    ctl.tick()
    await settle()
    assert held.done()


async def test_active_at_start_needs_a_prior_above_the_lowest_and_not_false(caplog):
    # Said at start only where the operator set it and it cannot apply; the default is quiet.
    for params, priors in (
        ({"maxPrefillTokens": 1000, "activeAtStart": False}, PRIOR),  # turned off
        ({"maxPrefillTokens": 1000}, {}),  # default, no prior: no hold, nothing said
        ({"maxPrefillTokens": 1000}, {0: PRIOR[10]}),  # default, lowest only
        ({"maxPrefillTokens": 1000, "activeAtStart": True}, {}),  # no prior: said, no hold
        ({"maxPrefillTokens": 1000, "activeAtStart": True}, {0: PRIOR[10]}),  # lowest only
    ):
        clock = Clock()
        fleet = Fleet(clock)
        with caplog.at_level(logging.WARNING, "extproc.flowcontrol"):
            caplog.clear()
            ctl = make_with(fleet, clock, params, reserve_priors=priors)
        for _ in range(3):
            place(ctl, fleet, await ctl.admit(req(800)))
        assert ctl.gate is not None and ctl.gate.held == 0
        said = "activeAtStart has no effect" in caplog.text
        assert said == (params.get("activeAtStart") is True)


def make_with(fleet: Fleet, clock: Clock, params: dict, **overrides: object) -> FlowController:
    plugins = [tokens_detector(CAP), {"type": "prefill-gate", "parameters": params}]
    return controller(fleet, plugins, clock=clock, **overrides)


async def test_without_the_gate_the_same_request_is_released_at_once():
    clock = Clock()
    fleet = Fleet(clock)
    ctl = make(fleet, clock, gate=False)
    ctl.release(await ctl.admit(req(100, priority=10)))
    for _ in range(3):
        place(ctl, fleet, await ctl.admit(req(800)))  # would be held by the gate


async def test_interactive_goes_where_the_least_prefill_is_unfinished():
    clock = Clock()
    fleet = Fleet(clock)
    ctl = make(fleet, clock, {"maxPrefillTokens": 1000})
    place(ctl, fleet, await ctl.admit(req(900)), "A")
    place(ctl, fleet, await ctl.admit(req(300)), "B")
    hi = await ctl.admit(req(400, priority=10))
    assert hi.endpoints == {"B"}
    other = Clock()
    off = make(Fleet(other), other, {"steerHigherBands": False})
    assert (await off.admit(req(400, priority=10))).endpoints == {"A", "B"}


async def test_placement_elsewhere_than_the_target_moves_the_count():
    clock = Clock()
    fleet = Fleet(clock)
    ctl = make(fleet, clock, {"maxPrefillTokens": 1000})
    ctl.release(await ctl.admit(req(100, priority=10)))
    first = await ctl.admit(req(600))
    other = "B" if first.target == "A" else "A"
    place(ctl, fleet, first, other)  # the router chose the other endpoint with room
    assert ctl.gate is not None
    assert ctl.gate.unfinished(other, dict(fleet.endpoints())[other]) == 600
    assert ctl.gate.unfinished(first.target, dict(fleet.endpoints())[first.target]) == 0


async def test_requests_beyond_this_pickers_count_at_its_mean_size():
    clock = Clock()
    fleet = Fleet(clock)
    ctl = make(fleet, clock, {"maxPrefillTokens": 10_000})
    for size in (200, 400):
        place(ctl, fleet, await ctl.admit(req(size)), "A")
    clock.now += 1.0
    fleet.scrape(A=4)  # two of ours plus two of another replica's
    assert ctl.gate is not None
    state = dict(fleet.endpoints())["A"]
    assert ctl.gate.unfinished("A", state) == 200 + 400 + 2 * 300
    fleet.scrape(A=1)  # the older one is done (and retired), the younger not
    assert ctl.gate.unfinished("A", dict(fleet.endpoints())["A"]) == 400
    fleet.scrape(A=0)
    assert ctl.gate.unfinished("A", dict(fleet.endpoints())["A"]) == 0


async def test_a_server_without_first_token_counts_is_judged_by_its_in_flight_tokens(caplog):
    clock = Clock()
    fleet = Fleet(clock)
    ctl = make(fleet, clock, {"maxPrefillTokens": 1000})
    fleet.prefilling["A"] = None
    fleet.tokens["A"] = 5000  # decoding requests too: it holds back more, never less
    ctl.release(await ctl.admit(req(100, priority=10)))
    ticket = await ctl.admit(req(300))
    assert ticket.endpoints == {"B"}
    assert ctl.gate is not None and ctl.gate.blind >= 1
    assert "no fresh first-token" in caplog.text


def test_config_errors_are_located():
    fc = {"saturationDetector": {"pluginRef": "concurrency-detector"}}
    det = {"type": "concurrency-detector"}
    with pytest.raises(ConfigError) as err:
        build_flow_config(fc, None, [det, {"type": "prefill-gate", "parameters": {"x": 1}}])
    assert "plugins[1].parameters" in str(err.value)
    with pytest.raises(ConfigError) as err:
        bad = {"type": "prefill-gate", "parameters": {"activeWindow": "soon"}}
        build_flow_config(fc, None, [det, bad])
    assert "activeWindow" in str(err.value)
    with pytest.raises(ConfigError):
        build_flow_config(fc, None, [det, {"type": "prefill-gate"}, {"type": "prefill-gate"}])
    assert build_flow_config(fc, None, [det]).gate is None


async def test_a_placement_just_before_a_scrape_is_not_taken_as_done():
    # Behind Envoy a long prompt placed just before a scrape was not in the engine's count
    # yet; read as done, a batch request was released behind it.
    clock = Clock()
    fleet = Fleet(clock)
    ctl = make(fleet, clock, {"maxPrefillTokens": 1000})
    place(ctl, fleet, await ctl.admit(req(900)), "A")
    clock.now += 0.05
    fleet.scrape(A=0)  # taken before the request reached the engine
    assert ctl.gate is not None
    assert ctl.gate.unfinished("A", dict(fleet.endpoints())["A"]) == 900
    clock.now += 0.3
    fleet.scrape(A=0)  # it has surely arrived by now: done
    assert ctl.gate.unfinished("A", dict(fleet.endpoints())["A"]) == 0


async def test_a_late_scrape_still_counts_and_what_came_since_counts_whole():
    # Past the detectors' staleness bound (0.2 s) the count is still used: placements
    # since shortly before it count whole, so it only holds back more. Judged blind
    # instead, every in-flight prompt token (decoding ones too) counted.
    clock = Clock()
    fleet = Fleet(clock)
    ctl = make(fleet, clock, {"maxPrefillTokens": 1000})
    place(ctl, fleet, await ctl.admit(req(300)), "A")
    clock.now += 1.0
    fleet.scrape(A=1)
    clock.now += 0.5  # the scrape is 0.5 s old: stale for the detectors
    place(ctl, fleet, await ctl.admit(req(200)), "A")
    fleet.tokens["A"] = 5000  # in flight, decoding ones too
    assert ctl.gate is not None
    assert ctl.gate.unfinished("A", dict(fleet.endpoints())["A"]) == 300 + 200
    assert ctl.gate.blind == 0
    clock.now += 2.0  # too old to use at all
    assert ctl.gate.unfinished("A", dict(fleet.endpoints())["A"]) == 5000
    assert ctl.gate.blind == 1


async def test_fleet_view_counts_a_peers_placement_at_its_own_size():
    # Replica b placed a short prompt on A, then replica a a long one; the engine shows
    # one unfinished: the younger, a's long one. Without the fleet view b takes it for its
    # own short one (all it knows of): room for a batch request. With it, a's placement
    # counts at its own size and time: held.
    def replica(fleet_view: bool) -> tuple[FlowController, Clock, Fleet]:
        clock = Clock()
        fleet = Fleet(clock)
        ctl = make(fleet, clock, {"maxPrefillTokens": 1000, "fleetView": fleet_view})
        return ctl, clock, fleet

    held = {}
    for fleet_view in (False, True):
        ctl, clock, fleet = replica(fleet_view)
        assert ctl.gate is not None and ctl.gate.fleet_view is fleet_view
        place(ctl, fleet, await ctl.admit(req(100)), "A")  # b's short one
        clock.now += 0.1
        a = replica(True)[0]  # the peer (its own clock: ages travel, not times)
        assert a.gate is not None
        a.placed(await a.admit(req(900)), "A")
        a.gate.use_clock(lambda: 1000.0 + 1.0)  # a publishes one second later
        clock.now += 1.0
        fleet.scrape(A=1, B=1)  # one unfinished on A: a's long one; B busy with another
        if fleet_view:
            ctl.gate.peers_placed(
                {addr: [(age / 1000, t) for age, t in items]
                 for addr, items in a.gate.published().items()}
            )  # fmt: skip
        state = dict(fleet.endpoints())["A"]
        unfinished = ctl.gate.unfinished("A", state)
        assert unfinished == (900 if fleet_view else 100)
        ctl.release(await ctl.admit(req(100, priority=10)))  # interactive active
        fleet.scrape(A=1, B=1)
        fleet.prefilling["B"] = 0
        fleet.requests["B"] = 0
        # B has nothing unfinished: a batch request goes there either way; on A only
        # without the fleet view.
        ticket = await ctl.admit(req(300))
        held[fleet_view] = ticket.endpoints
    assert held == {False: {"A", "B"}, True: {"B"}}


def test_fleet_view_publishes_the_youngest_placements_with_their_ages():
    from extproc.flowcontrol.prefill_gate import _PUBLISHED_MAX, PrefillGate

    now = [50.0]
    gate = PrefillGate(PrefillGate.Params(fleetView=True), clock=lambda: now[0])
    for i in range(_PUBLISHED_MAX + 3):
        gate.released(object(), "A", 10 + i)
        now[0] += 0.01
    pub = gate.published()
    assert list(pub) == ["A"] and len(pub["A"]) == _PUBLISHED_MAX
    assert pub["A"][-1] == [10, 10 + _PUBLISHED_MAX + 2]  # the youngest, 10 ms old
    assert pub["A"][0][1] == 13  # the three oldest left out
    # Read back: dated by their ages at the reader's now, oldest first.
    other = PrefillGate(PrefillGate.Params(fleetView=True), clock=lambda: 7.0)
    other.peers_placed({"A": [(0.5, 300), (0.1, 200)]})
    assert other._peers == {"A": [(6.5, 300), (6.9, 200)]}
    assert other.peer_counts() == {"A": 2} and other.peer_view is True


def test_fleet_view_lost_falls_back_to_this_replica_and_says_so_once(caplog):
    from extproc.flowcontrol.prefill_gate import PrefillGate

    caplog.set_level(logging.INFO, logger="extproc.flowcontrol")
    gate = PrefillGate(PrefillGate.Params(fleetView=True), clock=lambda: 7.0)
    gate.peers_placed({"A": [(0.5, 300)]})
    gate.peers_lost()
    gate.peers_lost()
    assert gate.peer_counts() == {} and gate.peer_view is False
    assert caplog.text.count("other replicas' placements are unknown") == 1
    gate.peers_placed({})
    assert gate.peer_view is True and "known again" in caplog.text


def test_placements_are_bounded_without_judgements():
    # A batch-only pool: no higher band active, nothing steered, so nothing retires them.
    from extproc.flowcontrol.prefill_gate import _KEPT_MAX, PrefillGate

    gate = PrefillGate(clock=lambda: 1.0)
    for i in range(_KEPT_MAX + 50):
        gate.released(i, "A", 100)
        gate.placed(i, "B")
    assert len(gate._own["B"]) == _KEPT_MAX and not gate._own["A"]
