"""The body edit behind `flow_control.engine_priority`: the band as the engine's `priority`
(-band), inserted without copying the body, or replacing the client's; and the streamed
chunks that carry `head + body[rest_from:]` across chunk boundaries."""

from __future__ import annotations

import orjson
import pytest

from extproc import protocol
from extproc.core import Api
from extproc.flowcontrol.engine_priority import (
    EnginePriority,
    engine_priority,
    with_priority,
)
from extproc.requests.parse import parse_request
from extproc.requests.settings import ParseSettings
from extproc.server import wire


def edited(body: bytes, value: int, client_set: bool = False) -> bytes:
    return with_priority(body, value, client_set=client_set).join(body)


def test_higher_band_smaller_number():
    assert [engine_priority(b) for b in (10, 1, 0, -1)] == [-10, -1, 0, 1]


@pytest.mark.parametrize(
    "body",
    [b'{"model":"m"}', b'  \n{ "model" : "m" }\n', b"{}", b" { \t} ", b'{"a":{"priority":3}}'],
)
def test_inserted_at_the_top_level(body):
    out = edited(body, -10)
    doc = orjson.loads(out)
    assert doc["priority"] == -10
    assert {k: v for k, v in doc.items() if k != "priority"} == orjson.loads(body)


def test_insert_keeps_the_body_and_adds_only_a_head():
    body = b'{"model":"m","prompt":"' + b"x" * 1000 + b'"}'
    edit = with_priority(body, 0, client_set=False)
    assert edit.rest_from == 1 and edit.head == b'{"priority":0,'
    assert edit.length(len(body)) == len(edit.join(body))


@pytest.mark.parametrize(
    "body",
    [
        b'{"priority":5,"model":"m"}',
        b'{"model":"m","priorit\\u0079":-7,"priority":-8}',
        b'{"priority":"high","model":"m"}',
        b'{"priority":null,"model":"m","n":123456789012345678901234567890}',
    ],
)
def test_the_clients_priority_is_replaced(body):
    out = edited(body, -10, client_set=True)
    doc = orjson.loads(out.replace(b"123456789012345678901234567890", b"1"))
    assert doc["priority"] == -10
    assert out.count(b"priorit") == 1


def test_the_parser_tells_whether_the_client_set_one():
    s = ParseSettings()
    for path, doc in [
        ("/v1/chat/completions", {"model": "m", "messages": []}),
        ("/v1/completions", {"model": "m", "prompt": "x"}),
        ("/v1/responses", {"model": "m", "input": "x"}),
        ("/v1/embeddings", {"model": "m", "input": "x"}),
    ]:
        plain = parse_request(path, {}, orjson.dumps(doc), s)
        assert not plain.client_priority
        forged = parse_request(path, {}, orjson.dumps({**doc, "priority": "x"}), s)
        assert forged.client_priority, path
    escaped = b'{"model":"m","messages":[],"priorit\\u0079":1}'
    assert parse_request("/v1/chat/completions", {}, escaped, s).client_priority


def test_apis_without_the_field_are_skipped_and_counted():
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    ep = EnginePriority(reg)
    assert ep.edit(Api.MESSAGES, 10, b'{"model":"m"}', client_set=False) is None
    assert ep.edit(Api.CHAT, 10, b"", client_set=False) is None
    assert ep.edit(Api.CHAT, 10, b'{"model":"m"}', client_set=False) is not None
    assert reg.get_sample_value("extproc_flow_engine_priority_total", {"outcome": "skipped"}) == 2
    assert reg.get_sample_value("extproc_flow_engine_priority_total", {"outcome": "inserted"}) == 1


@pytest.mark.parametrize(
    "size", [0, 10, protocol.BODY_CHUNK_BYTES - 5, 3 * protocol.BODY_CHUNK_BYTES]
)
@pytest.mark.parametrize("head", [b"", b'{"priority":-10,', b"H" * (protocol.BODY_CHUNK_BYTES + 7)])
def test_streamed_chunks_carry_head_and_rest(size, head):
    body = bytes(range(256)) * (size // 256 + 1)
    body = body[:size]
    rest_from = min(1, size)
    chunks = list(wire.streamed_body(body, end_of_stream=True, head=head, rest_from=rest_from))
    parts = [c.request_body.response.body_mutation.streamed_response for c in chunks]
    assert b"".join(p.body for p in parts) == head + body[rest_from:]
    assert all(len(p.body) <= protocol.BODY_CHUNK_BYTES for p in parts)
    assert [p.end_of_stream for p in parts] == [False] * (len(parts) - 1) + [True]


def outcome(reg, name: str) -> float:
    return reg.get_sample_value("extproc_flow_engine_priority_total", {"outcome": name})


def test_the_header_form_sets_the_header_and_leaves_the_body():
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    ep = EnginePriority(reg, "header")
    body = b'{"model":"m","priority":3}'
    for api in (Api.CHAT, Api.COMPLETIONS, Api.RESPONSES, Api.MESSAGES):
        out = ep.plan(api, 10, body, client_set=True)
        assert out.set_headers == ((protocol.ENGINE_PRIORITY_HEADER, "-10"),)
        assert out.body is None and out.remove_headers == ()
    # Decided without a body (a body mode that never shows it): the header still goes.
    assert ep.plan(Api.CHAT, -1, None, client_set=False).set_headers == (
        (protocol.ENGINE_PRIORITY_HEADER, "1"),
    )
    assert outcome(reg, "header") == 5
    # Embeddings: vLLM reads only the body there, so the band goes into it.
    out = ep.plan(Api.EMBEDDINGS, 1, b'{"model":"m","input":"x"}', client_set=False)
    assert out.body is not None and out.set_headers == ()
    assert out.remove_headers == (protocol.ENGINE_PRIORITY_HEADER,)
    assert outcome(reg, "inserted") == 1
    # No band, or an API without priority: the client's header is removed, nothing set.
    for api, band in ((Api.CHAT, None), (Api.UNKNOWN, 10)):
        out = ep.plan(api, band, body, client_set=False)
        assert out.set_headers == () and out.body is None
        assert out.remove_headers == (protocol.ENGINE_PRIORITY_HEADER,)
    assert outcome(reg, "skipped") == 2


def test_the_body_form_removes_the_clients_header_whatever_happens():
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    ep = EnginePriority(reg)  # "body", the default form
    for api, band, body in (
        (Api.CHAT, 10, b'{"model":"m"}'),
        (Api.CHAT, 10, None),
        (Api.MESSAGES, 10, b'{"model":"m"}'),
        (Api.CHAT, None, b'{"model":"m"}'),
    ):
        out = ep.plan(api, band, body, client_set=False)
        assert out.set_headers == () and out.remove_headers == (protocol.ENGINE_PRIORITY_HEADER,)
    assert outcome(reg, "inserted") == 1 and outcome(reg, "skipped") == 3
    assert outcome(reg, "header") == 0


@pytest.mark.parametrize(
    "value,via", [(True, "body"), ("body", "body"), ("header", "header"), (False, None)]
)
def test_the_setting_names_the_form(value, via):
    import msgspec

    from extproc.flowcontrol.admission import Admission
    from extproc.flowcontrol.config import FlowControlSettings, build_flow_config

    s = msgspec.convert({"engine_priority": value}, FlowControlSettings)
    admission = Admission(build_flow_config(None, None, [], s), lambda: (), registry=None)
    ep = admission.engine_priority
    assert (ep.via if ep is not None else None) == via


def test_an_unknown_form_is_refused():
    import msgspec

    from extproc.flowcontrol.config import FlowControlSettings

    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"engine_priority": "trailer"}, FlowControlSettings)
