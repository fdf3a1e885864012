"""A placed request's own output (its max_tokens, in place of the concurrency detector's
constant) counts on its endpoint until the request ends, not until its ticket is released:
the router releases the ticket when the ext_proc stream ends, at the response headers,
while the in-flight count (and the engine's KV) lasts to the access-log entry."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from extproc.core import EndpointState
from extproc.flowcontrol.config import build_flow_config
from extproc.flowcontrol.controller import FlowController, FlowRequest

CAP = 1000  # tokens on the one endpoint
BASE = 100  # the detector's output per in-flight request (`outputTokens`)


class Fleet:
    def __init__(self) -> None:
        self.requests = 0
        self.tokens = 0  # in-flight prompt tokens, as the router counts them

    def endpoints(self) -> Sequence[tuple[str, EndpointState]]:
        return [("A", EndpointState(inflight_requests=self.requests, inflight_tokens=self.tokens))]

    def states(self) -> Sequence[EndpointState]:
        return [s for _, s in self.endpoints()]


def make(fleet: Fleet, dispatch_on_end: bool = False) -> FlowController:
    params = {"concurrencyMode": "tokens", "maxTokenConcurrency": CAP, "outputTokens": BASE}
    plugins = [{"type": "concurrency-detector", "parameters": params}]
    cfg = build_flow_config(
        {"saturationDetector": {"pluginRef": "concurrency-detector"}}, None, plugins
    )
    return FlowController(
        detector=cfg.detector,
        states=fleet.states,
        band=cfg.band,
        usage_limit=cfg.usage_limit,
        endpoints=fleet.endpoints,
        dispatch_on_end=dispatch_on_end,
    )


def req(prompt: int, output: int) -> FlowRequest:
    return FlowRequest("t", 0, prompt + output, 10, output_tokens=output)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def long_one_placed(ctl: FlowController, fleet: Fleet):
    ticket = await ctl.admit(req(400, 300))  # counts 400 + 300 on A
    fleet.requests += 1
    fleet.tokens += 400
    ctl.placed(ticket, "A")
    return ticket


async def test_own_output_counts_until_the_request_ends_not_the_ticket():
    fleet = Fleet()
    ctl = make(fleet)
    first = await long_one_placed(ctl, fleet)
    # 700 on A: 350 more does not fit (counted with the constant, 400 + 100 + 350 would).
    second = asyncio.create_task(ctl.admit(req(250, 100)))
    await settle()
    assert not second.done()
    ctl.release(first, output_held=True)  # the stream ended at the response headers
    ctl.tick()
    await settle()
    assert not second.done(), "released while the first still holds its 300 output tokens"
    ctl.ended(first)  # its access-log entry: now it counts as the router's count says
    ctl.ended(first)  # (idempotent)
    ctl.tick()
    await settle()
    assert second.done()


async def test_a_release_without_a_hold_ends_the_output_at_once():
    # What every release did before: the output fell back to the constant at the
    # ticket's release, with the request still running.
    fleet = Fleet()
    ctl = make(fleet)
    first = await long_one_placed(ctl, fleet)
    second = asyncio.create_task(ctl.admit(req(250, 100)))
    await settle()
    assert not second.done()
    ctl.release(first)
    await settle()
    assert second.done()


async def test_an_end_releases_the_queue_at_once_with_dispatch_on_end():
    # The end's room goes to the queue as the entry arrives, not at the next tick (traced
    # in the overload bench: interactive requests waited a median 70-90 ms past the
    # engine's free room, the access log's flush and the tick).
    fleet = Fleet()
    ctl = make(fleet, dispatch_on_end=True)
    first = await long_one_placed(ctl, fleet)
    second = asyncio.create_task(ctl.admit(req(250, 100)))
    await settle()
    ctl.release(first, output_held=True)
    await settle()
    assert not second.done()
    fleet.requests -= 1  # the router releases the in-flight count, then tells flow control
    fleet.tokens -= 400
    ctl.ended(first)  # no tick
    await settle()
    assert second.done()
    assert ctl.end_dispatches == 1
    ctl.ended(first)  # nothing queued: no dispatch counted
    assert ctl.end_dispatches == 1


async def test_without_dispatch_on_end_the_next_tick_releases():
    fleet = Fleet()
    ctl = make(fleet)
    first = await long_one_placed(ctl, fleet)
    second = asyncio.create_task(ctl.admit(req(250, 100)))
    await settle()
    ctl.release(first, output_held=True)
    fleet.requests -= 1
    fleet.tokens -= 400
    ctl.ended(first)
    await settle()
    assert not second.done()
    ctl.tick()
    await settle()
    assert second.done()
    assert ctl.end_dispatches == 0
