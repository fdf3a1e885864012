"""Every processing mode a gateway can announce, request and response side, over real gRPC:
response chunks echoed in FULL_DUPLEX_STREAMED, CONTINUE elsewhere, trailers answered,
mode_override where Envoy could honour it, the served endpoint taking over the accounting."""

from __future__ import annotations

import grpc
import orjson
import pytest

from extproc.server.app import App
from extproc.testing import (
    BUFFERED,
    FULL_DUPLEX,
    NONE,
    ExtProcClient,
    body_chunks,
    destination,
    post,
    request_body,
    request_headers,
    response_body,
    response_headers,
    response_trailers,
)
from tests.conftest import ENDPOINTS

pb = __import__("extproc.testing", fromlist=["pb"]).pb
STREAMED = pb.ProcessingMode.STREAMED
PARTIAL = pb.ProcessingMode.BUFFERED_PARTIAL
CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "modes"}]})
BODY_MODES = [NONE, STREAMED, BUFFERED, PARTIAL, FULL_DUPLEX]


def kinds(responses) -> list[str]:
    return [r.WhichOneof("response") for r in responses]


def request_side(mode: int, response_mode: int) -> list:
    """The request as Envoy sends it in `mode`."""
    first = request_headers(post("/v1/chat/completions"), mode=mode, response_mode=response_mode)
    if mode == NONE:
        return [first]
    return [first, *body_chunks(CHAT, 16 if mode in (STREAMED, FULL_DUPLEX) else 1 << 20)]


def response_chunks() -> list[bytes]:
    return [b'data: {"a": 1}\n\n', b"", b"\x00\xff not json at all", b"data: [DONE]\n\n"]


@pytest.mark.parametrize("response_mode", BODY_MODES, ids=pb.ProcessingMode.BodySendMode.Name)
@pytest.mark.parametrize("mode", BODY_MODES, ids=pb.ProcessingMode.BodySendMode.Name)
async def test_every_mode_pair_routes_and_answers_every_response_message(
    client: ExtProcClient, mode: int, response_mode: int
):
    chunks = response_chunks()
    msgs = [*request_side(mode, response_mode), response_headers()]
    if response_mode != NONE:
        msgs += [response_body(c, end_of_stream=i == len(chunks) - 1) for i, c in enumerate(chunks)]
    msgs.append(response_trailers())
    out = await client.exchange(msgs)
    dests = [d for d in map(destination, out) if d]
    assert len(dests) == 1 and dests[0] in ENDPOINTS
    resp_kinds = [k for k in kinds(out) if k.startswith("response")]
    n_body = len(chunks) if response_mode != NONE else 0
    # The generated config's pair: the picker ends the stream with OK at the response
    # headers, nothing being able to cut this request (server/cut_streams.py).
    ends_at_headers = mode == FULL_DUPLEX and response_mode == NONE
    trailers = [] if ends_at_headers else ["response_trailers"]
    assert resp_kinds == ["response_headers"] + ["response_body"] * n_body + trailers
    bodies = [r.response_body.response for r in out if r.WhichOneof("response") == "response_body"]
    if response_mode == FULL_DUPLEX:
        echoed = [
            (
                b.body_mutation.streamed_response.body,
                b.body_mutation.streamed_response.end_of_stream,
            )
            for b in bodies
        ]
        assert echoed == [(c, i == len(chunks) - 1) for i, c in enumerate(chunks)]
    else:
        assert all(not b.HasField("body_mutation") for b in bodies)
    # mode_override only where Envoy would apply it: no FULL_DUPLEX body mode on either side.
    overrides = [r.mode_override for r in out if r.HasField("mode_override")]
    if FULL_DUPLEX in (mode, response_mode) or response_mode == NONE:
        assert overrides == []
    else:
        assert len(overrides) == 1
        (o,) = overrides
        assert o.response_body_mode == NONE and o.response_trailer_mode == pb.ProcessingMode.SKIP
        assert o.request_body_mode == mode
        assert out[0].HasField("mode_override")  # on the request-header reply


async def test_streamed_request_is_decided_on_headers_and_counted(app: App, client: ExtProcClient):
    out = await client.exchange(request_side(STREAMED, FULL_DUPLEX))
    assert destination(out[0]) in ENDPOINTS
    assert kinds(out)[1:] == ["request_body"] * (len(out) - 1)  # each chunk CONTINUEs
    text = app.metrics.exposition().decode()
    assert 'extproc_decisions_without_body_total{mode="STREAMED"} 1.0' in text


async def test_buffered_partial_body_cut_at_the_limit_is_answered(app: App, client: ExtProcClient):
    """Envoy sends what fits its buffer with end_of_stream false and waits for the reply."""
    first = request_headers(post("/v1/chat/completions"), mode=PARTIAL)
    out = await client.exchange([first, request_body(CHAT[:20], end_of_stream=False)])
    assert kinds(out) == ["request_headers", "request_body"]
    assert destination(out[1]) in ENDPOINTS
    text = app.metrics.exposition().decode()
    assert 'extproc_decisions_without_body_total{mode="BUFFERED_PARTIAL"} 1.0' in text


async def test_served_endpoint_takes_over_inflight(app: App, client: ExtProcClient):
    inflight = app.router.inflight
    call = client.open()
    await call.write(request_headers(post("/v1/chat/completions"), response_mode=FULL_DUPLEX))
    await call.write(request_body(CHAT, end_of_stream=True))
    picked = destination(await call.read())
    await call.read()  # echoed body
    other = next(e for e in ENDPOINTS if e != picked)
    await call.write(response_headers(served=other))
    await call.read()
    assert inflight.requests(picked) == 0 and inflight.requests(other) == 1
    await call.write(response_body(b"x", end_of_stream=True))
    echoed = await call.read()
    assert echoed.response_body.response.body_mutation.streamed_response.end_of_stream
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:
        pass
    assert inflight.total() == 0
    assert "extproc_served_elsewhere_total 1.0" in app.metrics.exposition().decode()


async def test_served_endpoint_equal_to_the_pick_changes_nothing(app: App, client: ExtProcClient):
    call = client.open()
    # Response bodies streamed: the count lasts past the response headers, to the stream's end.
    await call.write(request_headers(post("/v1/chat/completions"), response_mode=FULL_DUPLEX))
    await call.write(request_body(CHAT, end_of_stream=True))
    picked = destination(await call.read())
    await call.read()
    await call.write(response_headers(served=picked))
    await call.read()
    assert app.router.inflight.requests(picked) == 1
    assert app.router.stats.served_elsewhere == 0
    call.cancel()


@pytest.mark.parametrize(
    ("entries", "allowed"),
    [
        (["127.0.0.12"], {"127.0.0.12:8000"}),  # no port: every endpoint on that address
        (["127.0.0.11:8000,127.0.0.13"], {"127.0.0.11:8000", "127.0.0.13:8000"}),
        (["127.0.0.12:9999"], None),  # wrong port: nothing eligible -> 503
    ],
)
async def test_subset_entries_per_the_gie_spec(client: ExtProcClient, entries, allowed):
    for _ in range(4):
        first = request_headers(post("/v1/chat/completions"), subset=entries)
        out = await client.exchange([first, request_body(CHAT, end_of_stream=True)])
        if allowed is None:
            assert out[0].immediate_response.status.code == 503
        else:
            assert destination(out[0]) in allowed


async def test_an_undefined_body_mode_routes_on_headers(app: App, client: ExtProcClient):
    out = await client.exchange([request_headers(post("/v1/chat/completions"), mode=99)])
    assert destination(out[0]) in ENDPOINTS
    assert (
        'extproc_decisions_without_body_total{mode="99"} 1.0' in app.metrics.exposition().decode()
    )
