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
