"""The refill credit from the decode's start (`flow_control.reserve_refill_credit: started`,
flowcontrol/refill.py): a request counts once a scrape of its server shows it past its first
token, predicted to end its output times the measured per-token decode time after that
scrape; a server without first-token counts is credited from placement (logged, counted)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest

from extproc.core import EndpointState
from extproc.flowcontrol.controller import FlowController, FlowRequest
from extproc.flowcontrol.refill import (
    ARRIVAL_S,
    CREDITS,
    SPEED_TRUSTED,
    PredictedRefill,
    StartedRefill,
)
from tests.flowcontrol.controllers import controller, tokens_detector
from tests.flowcontrol.test_reserve_rate import Clock, Fleet
from tests.flowcontrol.test_reserve_refill import lower_released
from tests.flowcontrol.test_reserve_refill_predicted import collected, configured


def scrape(prefilling: int | None, age_s: float = 0.0) -> EndpointState:
    """A scrape `age_s` old saying `prefilling` requests are before their first token."""
    return EndpointState(prefilling=prefilling, age_s=age_s, is_stale=False)


def timed(clock: Clock, horizon_s: float = 0.5) -> StartedRefill:
    """A credit whose decode time is measured: 0.1 s per output token after the scrape that
    saw each request decoding (on "C"; scrapes 0.05 s apart around its first token)."""
    r = StartedRefill(horizon_s, clock)
    for i in range(SPEED_TRUSTED):
        r.placed(("m", i), "C", 100, 10)
        clock.now += 0.06
        r.observe("C", scrape(1))  # still before its first token
        clock.now += 0.05
        r.observe("C", scrape(0))  # decoding
        clock.now += 1.0
        r.freed("C", 100, ("m", i))
    assert r.decode_per_token_s() == pytest.approx(0.1)
    assert CREDITS["started"] is StartedRefill
    return r


def test_a_request_queued_in_the_engine_is_credited_from_its_decode_not_its_placement():
    # 1p seed 2's C at 59.34 s (twenty-second session): requests predicted from their
    # placement to end within the horizon had queued in the engine's KV; none ended.
    clock = Clock()
    started = timed(clock)
    placement = PredictedRefill(0.5, clock)
    for i in range(SPEED_TRUSTED):  # its per-token time from placement: 0.1 s here too
        placement.placed(("m", i), "C", 100, 10)
        clock.now += 1.0
        placement.freed("C", 100, ("m", i))
    for r in (started, placement):
        r.placed("queued", "A", 700, 20)
    clock.now += 1.8  # the engine still has it waiting for KV
    started.observe("A", scrape(1))
    assert placement.credit("A") == 700  # predicted to end at 2.0 s from its placement
    assert started.credit("A") == 0  # not decoding: a prefill and 20 tokens away
    clock.now += 0.5
    started.observe("A", scrape(0))  # its first token, 2.3 s after placement
    clock.now += 1.6
    assert placement.credit("A") == 0  # past its predicted end, still running: late
    assert started.credit("A") == 700  # ends 2.0 s after the scrape that saw it decoding
    started.freed("A", 700, "queued")
    assert started.credit("A") == 0
    assert started.unstarted == 0


def test_the_engines_count_marks_the_oldest_as_decoding_and_spares_the_unarrived():
    clock = Clock()
    r = timed(clock)
    for name in ("first", "second", "third"):
        r.placed(name, "A", 500, 3)  # 0.3 s of decode each
        clock.now += 0.1
    r.placed("just-sent", "A", 400, 3)  # not at the engine yet: in no count of its own
    clock.now += ARRIVAL_S / 2
    r.observe("A", scrape(1))  # one of the three judged is before its first token
    assert r.credit("A") == 1000  # the two oldest; the third and the unjudged are not
    # A scrape older than this one is not read again; the next one is.
    r.observe("A", scrape(0, age_s=0.2))
    assert r.credit("A") == 1000
    clock.now += 0.1
    r.observe("A", scrape(0))
    assert r.credit("A") == 500 + 500 + 500 + 400


def test_with_peers_the_engines_count_is_read_as_this_replicas_newest():
    # Another replica's request is before its first token there too: the engine's count
    # (2) covers both, so this replica marks fewer of its own than are decoding (safe).
    clock = Clock()
    r = timed(clock)
    r.placed("old", "A", 500, 3)
    r.placed("new", "A", 600, 3)
    clock.now += 0.1
    r.observe("A", scrape(2))
    assert r.credit("A") == 0
    clock.now += 0.05
    r.observe("A", scrape(1))
    assert r.credit("A") == 500


def test_without_first_token_counts_the_server_is_credited_from_placement(caplog):
    clock = Clock()
    r = timed(clock)
    r.placed("x", "A", 700, 5)  # 0.5 s from placement at the placement's 0.111 s/token
    clock.now += 0.2
    with caplog.at_level(logging.WARNING, logger="extproc.flowcontrol"):
        r.observe("B", EndpointState())  # never scraped: the scraper says why, not this
        r.observe("A", scrape(None))  # scraped, but the engine does not export the counts
        r.observe("A", scrape(None))
    # Only this warning is read: `timed` logs at INFO, captured where an earlier test left
    # the package's loggers at INFO (test_layers, test_config: it failed in that order).
    warned = [m for m in caplog.messages if "no first-token count" in m]
    assert len(warned) == 1 and "from A" in warned[0]  # logged once
    assert r.credit("A") == 700  # predicted from its placement
    assert r.unstarted == 1
    clock.now += 0.1
    r.observe("A", scrape(1))  # counts again: from the decode's start from now on
    assert r.credit("A") == 0
    assert r.unstarted == 1


class Scraped(Fleet):
    """`Fleet`'s endpoints as scraped now, each with `prefilling` requests before their first
    token."""

    def __init__(self, **tokens: int) -> None:
        super().__init__(**tokens)
        self.prefilling = dict.fromkeys(self.tokens, 0)

    def endpoints(self) -> Sequence[tuple[str, EndpointState]]:
        return [
            (
                a,
                EndpointState(
                    inflight_requests=int(v > 0),
                    inflight_tokens=v,
                    prefilling=self.prefilling[a],
                    age_s=0.0,
                    is_stale=False,
                ),
            )
            for a, v in self.tokens.items()
        ]


async def test_the_controller_reads_the_scrapes_at_its_room_checks():
    # B has 700 free, 600 with the lower request on it: short of the 1,000 reserved by 400.
    # Eight interactive requests timed the decode on B; one of 3 output tokens is on B now.
    clock = Clock()
    fleet = Scraped()
    ctl: FlowController = controller(
        fleet,
        [tokens_detector(2000, outputTokens=0)],
        reserve=1,
        reserve_refill_s=0.4,
        reserve_refill_credit="started",
        clock=clock,
    )
    for _ in range(SPEED_TRUSTED):
        t = await ctl.admit(FlowRequest("t", 10, 1000, 10, output_tokens=10))
        ctl.placed(t, "B")
        fleet.prefilling["B"] = 1
        clock.now += 0.06
        await ctl.admit(FlowRequest("t", 10, 10, 10, output_tokens=1))  # a room check
        fleet.prefilling["B"] = 0
        clock.now += 0.05
        await ctl.admit(FlowRequest("t", 10, 10, 10, output_tokens=1))
        clock.now += 1.0
        ctl.release(t)
    assert isinstance(ctl.refill, StartedRefill)
    assert ctl.refill.decode_per_token_s() == pytest.approx(0.1)
    t = await ctl.admit(FlowRequest("t", 10, 600, 10, output_tokens=3))
    ctl.placed(t, "B")
    fleet.prefilling["B"] = 1  # queued in the engine: its 600 not credited, the lower waits
    clock.now += 0.1
    assert not await lower_released(ctl, fleet)
    fleet.prefilling["B"] = 0  # decoding: ends within 0.3 s, its 600 credited
    clock.now += 0.05
    assert await lower_released(ctl, fleet)


def test_configured_it_is_the_controllers_credit_and_its_fallback_is_counted():
    flow = configured("started")
    refill = flow.controller.refill
    assert isinstance(refill, StartedRefill) and refill.horizon_s == 0.3
    refill.observe("A", EndpointState())
    refill.credit("A")
    assert collected(flow, "extproc_flow_reserve_refill_unstarted") == 1
    # Nothing ended yet.
    assert collected(flow, "extproc_flow_reserve_refill_unpredicted") == 1


def test_a_first_token_placed_loosely_is_not_timed():
    # The first scrape read for a server (nothing before it) bounds a first token only by
    # the request's placement: 0.5 s before, too loose to time the decode by.
    clock = Clock()
    r = StartedRefill(0.5, clock)
    r.placed("loose", "A", 100, 10)
    clock.now += 0.5
    r.observe("A", scrape(0))
    clock.now += 1.0
    r.freed("A", 100, "loose")
    assert len(r._decode) == 0
    r.placed("tight", "A", 100, 10)
    clock.now += 0.1
    r.observe("A", scrape(0))  # placed 0.1 s before this scrape: within 0.2 s
    clock.now += 1.0
    r.freed("A", 100, "tight")
    assert list(r._decode) == [pytest.approx(0.1)]
