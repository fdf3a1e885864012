"""The per-stream state machine, driven over real gRPC the way Envoy drives it."""

from __future__ import annotations

import asyncio
import gc
import hashlib

import grpc
import orjson
import pytest

from extproc import protocol
from extproc.core import Prompt
from extproc.endpoints import parse_endpoints
from extproc.server.app import App
from extproc.testing import (
    BUFFERED,
    FULL_DUPLEX,
    NONE,
    ExtProcClient,
    body_chunks,
    destination,
    lb_metadata,
    post,
    request_body,
    request_headers,
    request_trailers,
    response_headers,
)
from tests.conftest import ENDPOINTS, with_server

CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def kinds(responses) -> list[str]:
    return [r.WhichOneof("response") for r in responses]


def streamed(responses) -> list[tuple[bytes, bool]]:
    out = []
    for r in responses:
        if r.WhichOneof("response") == "request_body":
            sr = r.request_body.response.body_mutation.streamed_response
            out.append((sr.body, sr.end_of_stream))
    return out


def error_of(resp) -> tuple[int, dict, dict[str, str]]:
    ir = resp.immediate_response
    headers = {o.header.key: o.header.raw_value.decode() for o in ir.headers.set_headers}
    return ir.status.code, orjson.loads(ir.body), headers


async def test_full_duplex_holds_headers_until_body_end_then_routes_and_echoes(
    client: ExtProcClient,
):
    out = await client.exchange(
        [request_headers(post("/v1/chat/completions")), *body_chunks(CHAT, 10)]
    )
    assert kinds(out)[0] == "request_headers"
    assert kinds(out)[1:] == ["request_body"]
    dest = destination(out[0])
    assert dest in ENDPOINTS
    assert lb_metadata(out[0]) == dest
    assert out[0].request_headers.response.clear_route_cache
    assert streamed(out) == [(CHAT, True)]


async def test_large_body_is_echoed_in_chunks_of_at_most_62000_bytes(client: ExtProcClient):
    body = orjson.dumps({"model": "m", "prompt": "x" * 200_000})
    out = await client.exchange([request_headers(post("/v1/completions")), *body_chunks(body)])
    chunks = streamed(out)
    assert all(len(c) <= protocol.BODY_CHUNK_BYTES for c, _ in chunks)
    assert [eos for _, eos in chunks] == [False] * (len(chunks) - 1) + [True]
    assert b"".join(c for c, _ in chunks) == body
    assert len(chunks) == -(-len(body) // protocol.BODY_CHUNK_BYTES)


async def test_trailers_end_the_body_and_get_their_own_reply_last(client: ExtProcClient):
    out = await client.exchange(
        [
            request_headers(post("/v1/chat/completions")),
            request_body(CHAT, end_of_stream=False),
            request_trailers({"x-checksum": "1"}),
        ]
    )
    assert kinds(out) == ["request_headers", "request_body", "request_trailers"]
    assert destination(out[0]) in ENDPOINTS
    # Trailers still follow, so the echoed body must not end the stream.
    assert streamed(out) == [(CHAT, False)]


async def test_empty_body_still_gets_one_empty_end_of_stream_chunk(client: ExtProcClient):
    out = await client.exchange(
        [request_headers(post("/unknown/path")), request_body(b"", end_of_stream=True)]
    )
    assert destination(out[0]) in ENDPOINTS
    assert streamed(out) == [(b"", True)]


async def test_bodyless_request_is_routed_at_header_time(client: ExtProcClient):
    out = await client.exchange(
        [request_headers({":method": "GET", ":path": "/v1/models"}, end_of_stream=True)]
    )
    assert kinds(out) == ["request_headers"]
    assert destination(out[0]) in ENDPOINTS


async def test_buffered_mode_continues_headers_and_routes_on_the_body(client: ExtProcClient):
    out = await client.exchange(
        [
            request_headers(post("/v1/chat/completions"), mode=BUFFERED),
            request_body(CHAT, end_of_stream=True),
        ]
    )
    assert kinds(out) == ["request_headers", "request_body"]
    assert destination(out[0]) is None
    dest = destination(out[1])
    assert dest in ENDPOINTS
    assert lb_metadata(out[1]) == dest
    assert out[1].request_body.response.clear_route_cache
    assert not out[1].request_body.response.HasField("body_mutation")


async def test_mode_without_body_routes_on_headers(client: ExtProcClient):
    out = await client.exchange([request_headers(post("/v1/chat/completions"), mode=NONE)])
    assert destination(out[0]) in ENDPOINTS


async def test_missing_protocol_config_is_treated_as_full_duplex(client: ExtProcClient):
    out = await client.exchange(
        [request_headers(post("/v1/chat/completions"), mode=None), *body_chunks(CHAT)]
    )
    assert kinds(out) == ["request_headers", "request_body"]


async def test_response_headers_pass_through_unchanged(client: ExtProcClient):
    out = await client.exchange(
        [request_headers(post("/v1/chat/completions")), *body_chunks(CHAT), response_headers()]
    )
    last = out[-1]
    assert last.WhichOneof("response") == "response_headers"
    assert not last.response_headers.response.HasField("header_mutation")


async def test_malformed_json_gets_400_openai_error(client: ExtProcClient):
    out = await client.exchange(
        [request_headers(post("/v1/chat/completions")), request_body(b"{nope", end_of_stream=True)]
    )
    assert kinds(out) == ["immediate_response"]
    status, body, headers = error_of(out[0])
    assert status == 400
    assert headers["content-type"] == "application/json"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"]


async def test_missing_model_gets_400(client: ExtProcClient):
    out = await client.exchange(
        [
            request_headers(post("/v1/chat/completions")),
            request_body(b'{"messages": []}', end_of_stream=True),
        ]
    )
    assert error_of(out[0])[0] == 400


async def test_client_sent_destination_header_never_decides(client: ExtProcClient):
    spoof = {protocol.DESTINATION_HEADER: "6.6.6.6:80", protocol.SUBSET_HINT_KEY: "6.6.6.6:80"}
    for _ in range(10):
        out = await client.exchange(
            [request_headers(post("/v1/chat/completions", spoof)), *body_chunks(CHAT)]
        )
        assert destination(out[0]) in ENDPOINTS


async def test_subset_hint_restricts_the_pick(client: ExtProcClient):
    only = ENDPOINTS[1]
    for _ in range(10):
        out = await client.exchange(
            [
                request_headers(post("/v1/chat/completions"), subset=[only, "127.0.9.9:1"]),
                *body_chunks(CHAT),
            ]
        )
        assert destination(out[0]) == only


@pytest.mark.parametrize("subset", [[], ["127.0.9.9:1"]], ids=["empty", "disjoint"])
async def test_subset_hint_with_nothing_eligible_gets_503(client: ExtProcClient, subset):
    out = await client.exchange(
        [request_headers(post("/v1/chat/completions"), subset=subset), *body_chunks(CHAT)]
    )
    status, body, _ = error_of(out[0])
    assert status == 503
    assert body["error"]["code"] == "no_eligible_endpoints"


async def test_declared_content_length_past_limit_gets_413_at_header_time(settings):
    settings = with_server(settings, max_body_bytes=1000)
    async with (
        App(settings, []) as app,
        ExtProcClient(f"127.0.0.1:{app.port}") as client,
    ):
        out = await client.exchange(
            [request_headers(post("/v1/chat/completions", {"content-length": "1001"}))]
        )
    assert error_of(out[0])[0] == 413


async def test_streamed_body_past_limit_gets_413_without_waiting_for_the_end(settings):
    settings = with_server(settings, max_body_bytes=1000)
    async with (
        App(settings, parse_endpoints(ENDPOINTS[0])) as app,
        ExtProcClient(f"127.0.0.1:{app.port}") as client,
    ):
        call = client.open()
        await call.write(request_headers(post("/v1/chat/completions")))
        await call.write(request_body(b"x" * 600, end_of_stream=False))
        await call.write(request_body(b"x" * 600, end_of_stream=False))
        resp = await call.read()
        assert resp.WhichOneof("response") == "immediate_response"
        assert error_of(resp)[0] == 413
        call.cancel()


async def test_no_endpoints_gets_503(settings):
    async with App(settings, []) as app, ExtProcClient(f"127.0.0.1:{app.port}") as client:
        out = await client.exchange(
            [request_headers(post("/v1/chat/completions")), *body_chunks(CHAT)]
        )
    assert error_of(out[0])[0] == 503


async def test_inflight_counts_from_decision_until_stream_end(app: App, client: ExtProcClient):
    inflight = app.router.inflight
    call = client.open()
    await call.write(request_headers(post("/v1/chat/completions"), response_mode=FULL_DUPLEX))
    await call.write(request_body(CHAT, end_of_stream=True))
    first = await call.read()
    dest = destination(first)
    await call.read()  # the echoed body
    assert inflight.requests(dest) == 1
    await call.write(response_headers())
    await call.read()
    assert inflight.requests(dest) == 1  # response headers are not the end of the request
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert inflight.total() == 0


async def test_without_response_bodies_the_response_headers_end_the_accounting(
    app: App, client: ExtProcClient
):
    """The generated config sends no response bodies: the request's accounting ends at the
    response headers, and so does the stream of a request nothing can cut: the picker ends
    it with OK there (with `--response-trailers send` Envoy would keep it to the response's
    end, and reset the response if the picker died; server/cut_streams.py)."""
    inflight = app.router.inflight
    call = client.open()
    await call.write(request_headers(post("/v1/chat/completions")))  # response body NONE
    await call.write(request_body(CHAT, end_of_stream=True))
    dest = destination(await call.read())
    await call.read()  # the echoed body
    await call.write(response_headers())
    assert (await call.read()).HasField("response_headers")
    assert inflight.requests(dest) == 0  # released here, not at the stream's end
    assert await call.read() is grpc.aio.EOF  # not evictable: nothing to keep it open for
    assert await call.code() == grpc.StatusCode.OK
    assert inflight.total() == 0  # released once


async def test_concurrent_requests_spread_over_endpoints(app: App):
    async with ExtProcClient(f"127.0.0.1:{app.port}") as client:
        calls = []
        for _ in range(len(ENDPOINTS)):
            call = client.open()
            await call.write(request_headers(post("/v1/chat/completions")))
            await call.write(request_body(CHAT, end_of_stream=True))
            calls.append(call)
        dests = [destination(await c.read()) for c in calls]
        for c in calls:
            c.cancel()
    # Each decision counts the earlier ones in flight, so three open requests use all three.
    assert sorted(dests) == sorted(ENDPOINTS)


async def test_cancelled_stream_releases_inflight(app: App, client: ExtProcClient):
    call = client.open()
    await call.write(request_headers(post("/v1/chat/completions")))
    await call.write(request_body(CHAT, end_of_stream=True))
    await call.read()
    assert app.router.inflight.total() == 1
    call.cancel()
    for _ in range(100):
        if app.router.inflight.total() == 0:
            break
        await asyncio.sleep(0.01)
    assert app.router.inflight.total() == 0


async def test_body_digest_survives_the_echo(client: ExtProcClient):
    body = orjson.dumps({"model": "m", "prompt": "é" * 70_000})
    out = await client.exchange([request_headers(post("/v1/completions")), *body_chunks(body)])
    echoed = b"".join(c for c, _ in streamed(out))
    assert hashlib.sha256(echoed).digest() == hashlib.sha256(body).digest()


def live_prompts() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is Prompt)


async def test_a_stream_held_to_the_response_end_keeps_no_parsed_prompt(
    app: App, client: ExtProcClient
):
    """Gateways send response bodies (FULL_DUPLEX_STREAMED): the stream lasts as long as the
    response, and what it keeps for then must not grow with the prompt (the parsed prompt is
    about the body's size; bench/bench_held_streams.py)."""
    before = live_prompts()
    call = client.open()
    await call.write(request_headers(post("/v1/chat/completions"), response_mode=FULL_DUPLEX))
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 50_000}]})
    await call.write(request_body(body, end_of_stream=True))
    dest = destination(await call.read())
    await call.read()  # the echoed body
    await call.write(response_headers())
    await call.read()
    assert live_prompts() == before  # held, without the prompt
    assert app.router.inflight.requests(dest) == 1  # and still accounted
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert app.router.inflight.total() == 0


async def test_past_max_streams_the_first_message_gets_503_and_the_stream_ends(settings):
    """A stream over `server.max_streams` is refused with a reason the client sees; the
    open one is untouched, and a stream is accepted again once it ends."""
    async with (
        App(with_server(settings, max_streams=1), []) as app,
        ExtProcClient(f"127.0.0.1:{app.port}") as client,
    ):
        held = client.open()
        await held.write(request_headers(post("/v1/chat/completions")))
        await asyncio.sleep(0.05)  # the first stream is open before the second
        out = await client.exchange([request_headers(post("/v1/chat/completions"))])
        status, body, headers = error_of(out[0])
        assert (status, body["error"]["code"]) == (503, "picker_streams_full")
        assert headers["retry-after"] == "1"
        assert app.stream_handler is not None
        assert app.stream_handler.streams_refused == 1
        held.cancel()
        await asyncio.sleep(0.05)
        assert app.stream_handler.open_streams == 0
        out = await client.exchange(
            [request_headers(post("/v1/chat/completions")), *body_chunks(CHAT)]
        )
        # Accepted and routed: this app has no endpoint to route to.
        assert error_of(out[0])[1]["error"]["code"] == "no_eligible_endpoints"
