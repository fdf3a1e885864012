"""Where the proxy skips the response-header phase, the access-log entry tells the picker what
the response headers would have: the served endpoint (the index follows it), the status and
size (llm-d's request families), the time to first byte; decision response headers that could
not reach the client are counted and logged."""

from __future__ import annotations

import dataclasses
import logging
import re

import grpc
import orjson
import pytest

from extproc.config import Settings
from extproc.endpoints.request_end import Ended
from extproc.server.app import App
from extproc.testing import ExtProcClient, destination, post, request_body, request_headers
from tests.conftest import ENDPOINTS, with_server

CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "skipped " * 64}]})


@pytest.fixture
def settings(settings: Settings) -> Settings:
    # One fallback per decision: the proxy may serve another endpoint than the pick (a
    # single-address decision keeps no block keys for that while its request runs).
    return with_server(settings, fallbacks=1)


def metric(app: App, name: str) -> float:
    text = app.metrics.exposition().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


async def test_the_access_log_entry_stands_in_for_skipped_response_headers(
    app: App, client: ExtProcClient
):
    ends = app.router.ends
    assert ends is not None
    ends.ended(Ended("warm-up"))  # the access-log stream exists: placements are held
    call = client.open()
    await call.write(request_headers(post("/v1/chat/completions", {"x-request-id": "r1"})))
    await call.write(request_body(CHAT, end_of_stream=True))
    picked = (destination(await call.read()) or "").split(",")[0]  # the pick, then fallbacks
    await call.read()  # the echoed body
    await call.done_writing()  # Envoy ends the stream here: no response headers come
    while await call.read() is not grpc.aio.EOF:
        pass
    inflight = app.router.inflight
    assert inflight.requests(picked) == 1  # held until the request really ends
    assert metric(app, "inference_objective_response_sizes_count") == 0
    other = next(e for e in ENDPOINTS if e != picked)
    assert ends.ended(Ended("r1", ttfb_s=0.01, upstream=other, status=200, response_bytes=321))
    assert inflight.total() == 0
    assert app.router.stats.served_elsewhere == 1
    # The index follows the endpoint that served (the decision had recorded the pick).
    index = app.router.index
    assert index is not None
    keys = app.router.parse("/v1/chat/completions", post("/v1/chat/completions"), CHAT).block_keys
    assert keys
    found = await index.lookup(keys)
    assert found.matches.get(other, 0) == len(keys)
    # llm-d's request families closed with the entry's status and size.
    assert metric(app, "inference_objective_response_sizes_count") == 1
    assert metric(app, "inference_objective_response_sizes_sum") == 321
    assert app.router.stats.response_headers_unsent == 0


async def test_a_request_never_held_still_closes_its_families(app: App, client: ExtProcClient):
    # No access-log stream yet: the placement is released at the stream end, and llm-d's
    # request families close then (no size known).
    call = client.open()
    await call.write(request_headers(post("/v1/chat/completions", {"x-request-id": "r2"})))
    await call.write(request_body(CHAT, end_of_stream=True))
    await call.read()
    await call.read()
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:
        pass
    assert app.router.inflight.total() == 0
    assert metric(app, "inference_objective_request_duration_seconds_count") == 1
    assert metric(app, "inference_objective_response_sizes_count") == 0


async def test_unsent_decision_response_headers_are_counted_and_logged(app: App, caplog):
    router = app.router
    assert router.ends is not None
    router.ends.ended(Ended("warm-up"))
    headers = post("/v1/chat/completions", {"x-request-id": "r3"})
    routed = await router.route("/v1/chat/completions", headers, CHAT)
    # A profile with a session scorer adds its token to the decision's response headers.
    decision = dataclasses.replace(routed.decision, response_headers={"x-session-token": "t"})
    routed = dataclasses.replace(routed, decision=decision)
    router.finish(routed, responded=False)
    with caplog.at_level(logging.WARNING, logger="extproc.router"):
        router.ends.ended(Ended("r3", upstream=routed.placement.address, status=200))
    assert router.stats.response_headers_unsent == 1
    assert metric(app, "extproc_response_headers_unsent_total") == 1
    assert any("x-session-token" in r.getMessage() for r in caplog.records)


async def test_flow_control_without_response_headers_is_logged_and_counted(app: App, caplog):
    router = app.router

    class Admission:  # stands in for flow control: only the release matters here
        engine_priority = None

        def __init__(self) -> None:
            self.released: list[object] = []

        def release(self, ticket, *, output_held: bool = False, cuttable: bool = False) -> None:
            self.released.append(ticket)

        def stream_ended(self, ticket) -> None:
            pass

        def ended(self, ticket) -> None:
            pass

    headers = post("/v1/chat/completions", {"x-request-id": "r4"})
    routed = await router.route("/v1/chat/completions", headers, CHAT)
    admission = Admission()
    router.admission = admission  # type: ignore[assignment]
    ticket = object()
    routed = dataclasses.replace(routed, ticket=ticket)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="extproc.router"):
        router.finish(routed, responded=False)
    assert admission.released == [ticket]
    assert router.stats.admissions_without_response == 1
    assert metric(app, "extproc_admissions_without_response_total") == 1
    assert any("--response-headers send" in r.getMessage() for r in caplog.records)
    router.admission = None
