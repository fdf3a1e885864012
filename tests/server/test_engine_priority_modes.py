"""Engine priority in every request body mode a gateway can announce, over real gRPC
(`flow_control.engine_priority`, flowcontrol/engine_priority.py): the `header` form sets
`x-vllm-priority` to -band on the decision reply, whichever reply carries the decision (header
reply, BUFFERED body reply, the cut body of BUFFERED_PARTIAL), with no body mutation and
the streamed chunks echoed as they came; where the body is never seen (NONE, STREAMED) it is
still set. The `body` form removes the client's header on those bodiless decisions too.

Flow control is a stand-in here (the band comes from a request header); the real controller
is exercised behind Envoy in tests/e2e/test_flow_engine_priority.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import orjson
import pytest
from prometheus_client import CollectorRegistry

from extproc import protocol
from extproc.core import InferenceRequest
from extproc.flowcontrol.engine_priority import EnginePriority, Via
from extproc.flowcontrol.tickets import FlowRequest, Ticket
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
)
from tests.conftest import ENDPOINTS

pb = __import__("extproc.testing", fromlist=["pb"]).pb
STREAMED = pb.ProcessingMode.STREAMED
PARTIAL = pb.ProcessingMode.BUFFERED_PARTIAL
BODY_MODES = [NONE, STREAMED, BUFFERED, PARTIAL, FULL_DUPLEX]
BAND = "x-test-band"
HEADER = protocol.ENGINE_PRIORITY_HEADER


class Admission:
    """Flow control as the router sees it, admitting at once in the band the request names."""

    def __init__(self, via: Via) -> None:
        self.registry = CollectorRegistry()
        self.engine_priority = EnginePriority(self.registry, via)

    async def admit(self, request: InferenceRequest, uncached_tokens: int) -> Ticket:
        band = int(request.headers.get(BAND, "0"))
        return Ticket(FlowRequest("f", band, max(uncached_tokens, 1), request.body_bytes))

    def placed(self, ticket: Ticket, address: str = "") -> None:
        pass

    def release(self, ticket: Ticket, *, output_held: bool = False, cuttable: bool = False) -> None:
        pass

    def stream_ended(self, ticket: Ticket) -> None:
        pass

    def ended(self, ticket: Ticket) -> None:
        pass

    def evicted_error(self):  # pragma: no cover - nothing is evicted here
        raise AssertionError("no eviction in these tests")

    def outcome(self, name: str) -> float:
        value = self.registry.get_sample_value(
            "extproc_flow_engine_priority_total", {"outcome": name}
        )
        return value or 0.0


@pytest.fixture
def with_admission(app: App) -> Iterator[Callable[[Via], Admission]]:
    def install(via: Via) -> Admission:
        admission = Admission(via)
        app.router.admission = admission  # type: ignore[assignment]
        return admission

    yield install
    app.router.admission = None


def mutation(resp) -> pb.HeaderMutation | None:
    kind = resp.WhichOneof("response")
    if kind not in ("request_headers", "request_body"):
        return None
    return getattr(resp, kind).response.header_mutation


def set_value(resp, name: str) -> str | None:
    m = mutation(resp)
    if m is None:
        return None
    values = [o.header.raw_value.decode() for o in m.set_headers if o.header.key == name]
    assert len(values) <= 1
    return values[0] if values else None


def decision_reply(out) -> pb.ProcessingResponse:
    replies = [r for r in out if destination(r)]
    assert len(replies) == 1 and destination(replies[0]) in ENDPOINTS
    return replies[0]


def request_side(path: str, body: bytes, mode: int, headers: dict[str, str]) -> list:
    first = request_headers(post(path, headers), mode=mode)
    if mode == NONE:
        return [first]
    if mode == PARTIAL:  # cut at the proxy's buffer limit: routed on headers
        return [first, request_body(body[:20], end_of_stream=False)]
    return [first, *body_chunks(body, 16 if mode in (STREAMED, FULL_DUPLEX) else 1 << 20)]


def echoed(out) -> bytes:
    return b"".join(
        r.request_body.response.body_mutation.streamed_response.body
        for r in out
        if r.WhichOneof("response") == "request_body"
    )


CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "priority": 7})
MESSAGES = orjson.dumps(
    {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
)


@pytest.mark.parametrize("mode", BODY_MODES, ids=pb.ProcessingMode.BodySendMode.Name)
@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/messages", MESSAGES)])
async def test_header_form_sets_the_band_and_leaves_the_body(
    client: ExtProcClient, with_admission, mode: int, path: str, body: bytes
):
    admission = with_admission("header")
    # The client's own header (a forged place in the engine's queue) is overwritten.
    out = await client.exchange(request_side(path, body, mode, {BAND: "10", HEADER: "-1000"}))
    reply = decision_reply(out)
    assert set_value(reply, HEADER) == "-10"
    assert HEADER not in mutation(reply).remove_headers  # removal would drop the band too
    # No body mutation anywhere: BUFFERED sends none, FULL_DUPLEX echoes the chunks as sent
    # (the client's body `priority` included: vLLM reads the header first).
    for r in out:
        if r.WhichOneof("response") == "request_body":
            assert not r.request_body.response.body_mutation.HasField("body")
    if mode == FULL_DUPLEX:
        assert echoed(out) == body
    # A content-length is left alone: the body keeps its size.
    assert set_value(reply, "content-length") is None
    assert admission.outcome("header") == 1
    assert admission.outcome("skipped") == admission.outcome("inserted") == 0


async def test_header_form_default_band_is_zero(client: ExtProcClient, with_admission):
    with_admission("header")
    body = b'{"model":"m","prompt":"x"}'
    out = await client.exchange(request_side("/v1/completions", body, FULL_DUPLEX, {}))
    assert set_value(decision_reply(out), HEADER) == "0"


async def test_header_form_writes_embeddings_into_the_body(client: ExtProcClient, with_admission):
    """vLLM's pooling requests read only the body's `priority`: the body form's edit."""
    admission = with_admission("header")
    body = b'{"model":"m","input":"x"}'
    out = await client.exchange(
        request_side("/v1/embeddings", body, FULL_DUPLEX, {BAND: "-1", HEADER: "-9"})
    )
    reply = decision_reply(out)
    assert set_value(reply, HEADER) is None
    assert HEADER in mutation(reply).remove_headers
    assert echoed(out) == b'{"priority":1,' + body[1:]
    assert admission.outcome("inserted") == 1 and admission.outcome("header") == 0


@pytest.mark.parametrize("mode", [NONE, STREAMED, PARTIAL], ids=pb.ProcessingMode.BodySendMode.Name)
async def test_body_form_without_a_body_removes_the_clients_header(
    client: ExtProcClient, with_admission, mode: int
):
    """No body to write the band into: the engine runs it at its default priority
    (`skipped`), and the client's header does not choose for it."""
    admission = with_admission("body")
    out = await client.exchange(request_side("/v1/chat/completions", CHAT, mode, {HEADER: "-5"}))
    reply = decision_reply(out)
    assert HEADER in mutation(reply).remove_headers
    assert set_value(reply, HEADER) is None
    assert admission.outcome("skipped") == 1
