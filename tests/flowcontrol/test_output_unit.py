"""One unit for a request on a server: what it asks room for, what the controller counts
while it is pending, reserved or freed, and what the detector counts once it is placed. With
a concurrency detector that counts no output (`outputTokens` 0, the default) a placed request
counts its prompt alone, so everything else does too; with `outputTokens` both count prompt +
output (FlowRequest.counted_tokens)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from extproc.config import decode_settings
from extproc.core import EndpointState
from extproc.flowcontrol.admission import Admission
from extproc.flowcontrol.config import build_flow_config
from extproc.flowcontrol.controller import FlowController, FlowRequest
from extproc.flowcontrol.detectors import ConcurrencyDetector, UtilizationDetector
from extproc.flowcontrol.refill import WINDOW_S
from tests.flowcontrol.controllers import controller, settle, tokens_detector

CAP = 1000


class Fleet:
    """One endpoint, its in-flight figures as the router counts them (prompt tokens)."""

    def __init__(self) -> None:
        self.requests = 0
        self.tokens = 0

    def endpoints(self) -> Sequence[tuple[str, EndpointState]]:
        return [("A", EndpointState(inflight_requests=self.requests, inflight_tokens=self.tokens))]

    def states(self) -> Sequence[EndpointState]:
        return [s for _, s in self.endpoints()]

    def place(self, ctl: FlowController, ticket, prompt: int) -> None:
        self.requests += 1
        self.tokens += prompt
        ctl.placed(ticket, "A")


def req(prompt: int, output: int, priority: int = 0) -> FlowRequest:
    return FlowRequest("t", priority, prompt + output, 10, output_tokens=output)


def make(fleet: Fleet, output_tokens: int = 0, **kw) -> FlowController:
    return controller(fleet, [tokens_detector(CAP, outputTokens=output_tokens)], **kw)


async def test_a_request_counts_the_same_pending_and_placed_without_output_tokens():
    fleet = Fleet()
    ctl = make(fleet)
    ticket = await ctl.admit(req(400, 300))
    pending = ctl.saturation()
    assert ctl.pending_tokens == 400  # its prompt: what the detector will count
    fleet.place(ctl, ticket, 400)
    assert ctl.pending_tokens == 0
    assert ctl.saturation() == pending == 0.4
    assert ticket.request.tokens == 700  # fairness still charges prompt + output


async def test_room_is_asked_in_the_detectors_unit():
    fleet = Fleet()
    ctl = make(fleet)
    fleet.place(ctl, await ctl.admit(req(400, 300)), 400)
    # 400 + 500 fit under 1,000; counted with its output (800) it waited.
    second = asyncio.create_task(ctl.admit(req(500, 300)))
    await settle()
    assert second.done()
    # The same with the detector counting output: 400 + 300 + 500 + 300 does not fit.
    fleet = Fleet()
    ctl = make(fleet, output_tokens=300)
    fleet.place(ctl, await ctl.admit(req(400, 300)), 400)
    second = asyncio.create_task(ctl.admit(req(500, 300)))
    await settle()
    assert not second.done()
    assert ctl.pending_tokens == 0 and ctl.count == 1
    second.cancel()


async def test_the_room_freed_and_reserved_is_the_prompt_without_output_tokens():
    clock = _Clock()
    fleet = Fleet()
    ctl = make(fleet, reserve=1, reserve_refill_s=0.5, clock=clock)
    ticket = await ctl.admit(req(600, 200, priority=10))
    fleet.place(ctl, ticket, 600)
    ctl.release(ticket)
    assert ctl.refill is not None
    assert ctl.refill.rate("A") == 600 / WINDOW_S  # not 800: the detector never counted it
    held, top = ctl.reserve.held(0, (10, 0), None)
    assert (held, top) == (600, 10)


def test_a_configured_prior_is_taken_in_the_same_unit():
    # request_tokens 2,000 with 256 of output expected: the detector without outputTokens
    # counts its 1,744 prompt tokens, and the band's rate by the same share.
    detector = {"saturationDetector": {"pluginRef": "concurrency-detector"}}
    for params, size, rate in (({}, 1744, 872.0), ({"outputTokens": 64}, 2000, 1000.0)):
        plugins = [tokens_detector(CAP, **params)]
        s = decode_settings(
            {
                "flow_control": {
                    "admit_per_endpoint": True,
                    "reserve_for_higher_bands": 1,
                    "reserve_prior": {10: {"request_tokens": 2000, "tokens_per_s": 1000.0}},
                }
            }
        ).flow_control
        assert s is not None
        flow = Admission(
            build_flow_config(detector, None, plugins, s), lambda: (), registry=None,
            endpoints=list,
        )  # fmt: skip
        prior = flow.controller.reserve._priors[10]
        assert (prior.tokens, prior.prompt, prior.rate) == (size, 1744, rate)


def test_which_detectors_count_output():
    assert not ConcurrencyDetector().counts_output
    params = ConcurrencyDetector.Params(concurrencyMode="tokens", outputTokens=64)
    assert ConcurrencyDetector(params).counts_output
    assert UtilizationDetector().counts_output  # scraped KV grows by the output


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now
