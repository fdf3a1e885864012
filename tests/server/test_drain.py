"""The SIGTERM drain under the gateways' settings (response bodies FULL_DUPLEX_STREAMED, the
stream open to the response's end): it waits past `grace_s` for a response under way, up to
`response_grace_s`, and a stream still open at that bound is cut, counted by phase and
logged (the e2e proof behind Envoy: tests/gateways/test_drain.py)."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import msgspec
import pytest

from extproc.config import Settings
from extproc.endpoints import parse_endpoints
from extproc.server.app import App
from extproc.server.drain import DrainBounds
from extproc.server.families import DRAIN
from extproc.testing import (
    FULL_DUPLEX,
    ExtProcClient,
    body_chunks,
    destination,
    post,
    request_headers,
    response_body,
    response_headers,
)

CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


def drain_settings(settings: Settings, response_grace_s: float) -> Settings:
    server = msgspec.structs.replace(
        settings.server, grace_s=0.2, response_grace_s=response_grace_s
    )
    return msgspec.structs.replace(settings, server=server)


async def mid_response(client: ExtProcClient) -> grpc.aio.StreamStreamCall:
    """A stream as a gateway drives it, routed and one response chunk echoed."""
    call = client.open()
    await call.write(request_headers(post("/v1/chat/completions"), response_mode=FULL_DUPLEX))
    for m in body_chunks(CHAT):
        await call.write(m)
    routed = await call.read()
    assert destination(routed)
    await call.read()  # the request body echoed
    await call.write(response_headers())
    await call.read()
    await call.write(response_body(b"data: 1\n\n", end_of_stream=False))
    echoed = await call.read()
    assert echoed.response_body.response.body_mutation.streamed_response.body == b"data: 1\n\n"
    return call


async def test_a_response_under_way_outlasts_grace_and_finishes(settings, caplog):
    caplog.set_level(logging.INFO, logger="extproc.server.drain")
    s = drain_settings(settings, response_grace_s=20)
    async with App(s, parse_endpoints(",".join(s.endpoints))) as app:
        async with ExtProcClient(f"127.0.0.1:{app.port}") as client:
            call = await mid_response(client)
            stopping = asyncio.ensure_future(app.stop())
            await asyncio.sleep(0.6)  # three times grace_s: the stream must still be open
            assert not stopping.done()
            await call.write(response_body(b"data: 2\n\n", end_of_stream=True))
            last = await call.read()
            assert last.response_body.response.body_mutation.streamed_response.end_of_stream
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK
            started = time.monotonic()
            await asyncio.wait_for(stopping, 5)
            assert time.monotonic() - started < 2  # ended with the stream, not at the bound
        assert app.drain_stats.extended == 1
        assert sum(app.drain_stats.cut.values()) == 0
    assert "waiting up to 20 s for 1 open ext_proc streams (1 with a response body" in caplog.text


async def test_a_response_still_streaming_at_the_bound_is_cut_counted_and_logged(settings, caplog):
    caplog.set_level(logging.INFO, logger="extproc.server.drain")
    s = drain_settings(settings, response_grace_s=0.5)
    async with App(s, parse_endpoints(",".join(s.endpoints))) as app:
        async with ExtProcClient(f"127.0.0.1:{app.port}") as client:
            call = await mid_response(client)
            started = time.monotonic()
            await app.stop()
            assert 0.4 < time.monotonic() - started < 3
            with pytest.raises(grpc.aio.AioRpcError):
                await call.read()
        assert app.drain_stats.cut == {
            "response_body": 1,
            "before_response_body": 0,
            "no_response_body": 0,
        }
        exported = {
            (m.name, tuple(sorted(smp.labels.items()))): smp.value
            for m in DRAIN.families(app.drain_stats)
            for smp in m.samples
        }
        assert exported[("extproc_drain_cut_streams", (("phase", "response_body"),))] == 1
    cut = [r for r in caplog.records if r.name == "extproc.server.drain" and r.levelno >= 30]
    assert len(cut) == 1
    assert "1 ext_proc streams still open after 0.5 s were cut (1 mid-response" in cut[0].message


def test_only_streams_that_carry_a_response_body_lengthen_the_wait():
    bounds = DrainBounds(grace_s=10, response_grace_s=300)
    assert bounds.bound_s([]) == 10
    assert bounds.bound_s(["no_response_body", "no_response_body"]) == 10
    assert bounds.bound_s(["no_response_body", "before_response_body"]) == 300
    assert bounds.bound_s(["response_body"]) == 300
    assert DrainBounds(grace_s=10, response_grace_s=0).bound_s(["response_body"]) == 10
