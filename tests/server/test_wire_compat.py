"""Our upb message classes against Envoy's own API (the `envoy-data-plane` classes, generated
from Envoy's protos): each side decodes what the other encodes."""

from __future__ import annotations

import envoy_data_plane.envoy.config.core.v3 as core
import envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 as mode
import envoy_data_plane.envoy.service.ext_proc.v3 as envoy
import envoy_data_plane.envoy.type.v3 as envoy_type
import envoy_data_plane.google.protobuf as gpb
import orjson

from extproc import protocol
from extproc.core import Decision, Endpoint
from extproc.errors import BadRequest, NoEndpoints
from extproc.server import wire

pb = wire.pb


def to_ours(msg: envoy.ProcessingRequest) -> wire.ProcessingRequest:
    return wire.ProcessingRequest.FromString(bytes(msg))


def to_envoy(resp: wire.ProcessingResponse) -> envoy.ProcessingResponse:
    return envoy.ProcessingResponse.parse(resp.SerializeToString())


DECISION = Decision(endpoints=(Endpoint("10.0.0.7:8000"), Endpoint("10.0.0.8:8000")))


def test_envoy_headers_with_raw_values_and_subset_hint_decode():
    hint = gpb.Struct(
        fields={
            protocol.SUBSET_HINT_KEY: gpb.Value(
                list_value=gpb.ListValue(
                    values=[
                        gpb.Value(string_value="10.0.0.1:80"),
                        gpb.Value(string_value="10.0.0.2:80"),
                    ]
                )
            )
        }
    )
    msg = envoy.ProcessingRequest(
        request_headers=envoy.HttpHeaders(
            headers=core.HeaderMap(
                headers=[
                    core.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
                    core.HeaderValue(key="x-name", raw_value="caf\u00e9".encode()),
                ]
            ),
            end_of_stream=False,
        ),
        metadata_context=core.Metadata(filter_metadata={protocol.SUBSET_HINT_NAMESPACE: hint}),
        protocol_config=envoy.ProtocolConfiguration(
            request_body_mode=mode.ProcessingModeBodySendMode.FULL_DUPLEX_STREAMED
        ),
    )
    ours = to_ours(msg)
    assert ours.WhichOneof("request") == "request_headers"
    assert wire.header_map(ours.request_headers.headers) == {
        ":path": "/v1/chat/completions",
        "x-name": "caf\u00e9",
    }
    assert wire.subset_hint(ours) == {"10.0.0.1:80", "10.0.0.2:80"}
    assert ours.protocol_config.request_body_mode == wire.BodySendMode.FULL_DUPLEX_STREAMED


def test_envoy_body_chunks_and_trailers_decode():
    body = to_ours(
        envoy.ProcessingRequest(request_body=envoy.HttpBody(body=b"abc", end_of_stream=True))
    )
    assert (body.request_body.body, body.request_body.end_of_stream) == (b"abc", True)
    trailers = to_ours(
        envoy.ProcessingRequest(
            request_trailers=envoy.HttpTrailers(
                trailers=core.HeaderMap(headers=[core.HeaderValue(key="t", raw_value=b"1")])
            )
        )
    )
    assert trailers.WhichOneof("request") == "request_trailers"
    assert wire.header_map(trailers.request_trailers.trailers) == {"t": "1"}


def test_no_metadata_context_means_no_subset_hint():
    ours = to_ours(envoy.ProcessingRequest(request_headers=envoy.HttpHeaders()))
    assert wire.subset_hint(ours) is None


def test_routed_header_response_decodes_in_envoy():
    resp = to_envoy(wire.routed_headers(DECISION))
    common = resp.request_headers.response
    assert common.clear_route_cache is True
    (opt,) = common.header_mutation.set_headers
    assert opt.header.key == protocol.DESTINATION_HEADER
    assert opt.header.raw_value == b"10.0.0.7:8000,10.0.0.8:8000"
    assert opt.append_action == core.HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD
    lb = resp.dynamic_metadata.fields[protocol.LB_NAMESPACE].struct_value
    assert lb.fields[protocol.DESTINATION_KEY].string_value == "10.0.0.7:8000,10.0.0.8:8000"


def test_routed_body_response_for_buffered_mode_decodes_in_envoy():
    resp = to_envoy(wire.routed_body(DECISION))
    common = resp.request_body.response
    assert common.clear_route_cache is True
    assert common.header_mutation.set_headers[0].header.key == protocol.DESTINATION_HEADER


def test_streamed_body_chunks_decode_in_envoy():
    body = bytes(range(256)) * 500  # 128,000 bytes -> 3 chunks
    chunks = [to_envoy(r) for r in wire.streamed_body(body, end_of_stream=True)]
    parts = [c.request_body.response.body_mutation.streamed_response for c in chunks]
    assert b"".join(p.body for p in parts) == body
    assert [p.end_of_stream for p in parts] == [False, False, True]


def test_immediate_response_decodes_in_envoy():
    resp = to_envoy(wire.error_response(BadRequest("'model' is required")))
    ir = resp.immediate_response
    assert int(ir.status.code) == 400
    headers = {o.header.key: o.header.raw_value for o in ir.headers.set_headers}
    assert headers["content-type"] == b"application/json"
    assert orjson.loads(ir.body)["error"]["message"] == "'model' is required"
    assert (
        int(to_envoy(wire.error_response(NoEndpoints("x"))).immediate_response.status.code) == 503
    )


def test_continue_responses_select_the_right_oneof_in_envoy():
    assert to_envoy(wire.CONTINUE_REQUEST_HEADERS).request_headers is not None
    assert to_envoy(wire.CONTINUE_RESPONSE_HEADERS).response_headers is not None
    assert to_envoy(wire.CONTINUE_REQUEST_TRAILERS).request_trailers is not None


def test_envoy_responses_decode_in_ours():
    """The other direction: what Envoy's classes encode, our classes read."""
    resp = envoy.ProcessingResponse(
        request_headers=envoy.HeadersResponse(
            response=envoy.CommonResponse(
                header_mutation=envoy.HeaderMutation(
                    set_headers=[
                        core.HeaderValueOption(header=core.HeaderValue(key="k", raw_value=b"v"))
                    ],
                    remove_headers=["gone"],
                ),
                body_mutation=envoy.BodyMutation(
                    streamed_response=envoy.StreamedBodyResponse(body=b"x", end_of_stream=True)
                ),
                clear_route_cache=True,
            )
        ),
        dynamic_metadata=gpb.Struct(
            fields={
                "envoy.lb": gpb.Value(
                    struct_value=gpb.Struct(fields={"a": gpb.Value(string_value="b")})
                )
            }
        ),
    )
    ours = pb.ProcessingResponse.FromString(bytes(resp))
    common = ours.request_headers.response
    assert common.header_mutation.set_headers[0].header.raw_value == b"v"
    assert list(common.header_mutation.remove_headers) == ["gone"]
    assert common.body_mutation.streamed_response.end_of_stream
    assert ours.dynamic_metadata.fields["envoy.lb"].struct_value.fields["a"].string_value == "b"
    immediate = envoy.ProcessingResponse(
        immediate_response=envoy.ImmediateResponse(
            status=envoy_type.HttpStatus(code=429),
            body=b"{}",
            details="shed",
        )
    )
    ours = pb.ProcessingResponse.FromString(bytes(immediate))
    assert (ours.immediate_response.status.code, ours.immediate_response.details) == (429, "shed")


def test_decision_replies_are_built_once_per_destination_and_bounded():
    from extproc.core import Decision, Endpoint

    replies = wire.DecisionReplies(limit=2)
    a = Decision(endpoints=(Endpoint("10.0.0.1:8000"), Endpoint("10.0.0.2:8000")))
    same = Decision(endpoints=(Endpoint("10.0.0.1:8000"), Endpoint("10.0.0.2:8000")))
    assert replies.headers(a) is replies.headers(same)
    assert replies.headers(a) == wire.routed_headers(a)
    assert replies.body(a) == wire.routed_body(a)  # a body reply is its own entry
    hinted = Decision(endpoints=a.endpoints, headers={"x-prefiller-host-port": "10.0.0.3:8000"})
    assert replies.headers(hinted) == wire.routed_headers(hinted)  # headers are in the key
    assert replies.headers(hinted) is not replies.headers(a)
    assert len(replies._cache) <= 2  # emptied when full, never grows past the limit
