"""Any sequence of ext_proc messages, in any order, with any content: the picker answers or
ends the stream cleanly, keeps serving, and its in-flight counters return to zero."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc import protocol
from extproc.server import wire
from extproc.testing import (
    BUFFERED,
    FULL_DUPLEX,
    NONE,
    body_chunks,
    destination,
    post,
    request_body,
    request_headers,
    request_trailers,
    response_headers,
)
from tests.hostile.conftest import ENDPOINTS, ThreadedPicker

pb = wire.pb
paths = st.sampled_from(
    ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/x", "/"]
)
header_maps = st.builds(
    lambda path, extra: post(path, extra),
    paths,
    st.dictionaries(
        st.sampled_from(
            [
                protocol.DESTINATION_HEADER,
                "content-length",
                "x-request-id",
                protocol.EXPLAIN_HEADER,
                "x-session-token",
                "x-llm-d-video-fps",
            ]
        ),
        st.text(max_size=30),
        max_size=4,
    ),
)
bodies = st.one_of(
    st.binary(max_size=300),
    st.just(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'),
    st.just(b'{"model": "m", "prompt": [1, 2, 3]}'),
)
messages = st.one_of(
    st.builds(
        lambda h, eos, mode: request_headers(h, end_of_stream=eos, mode=mode),
        header_maps,
        st.booleans(),
        st.sampled_from([FULL_DUPLEX, BUFFERED, NONE, None, 1, 3]),
    ),
    st.builds(lambda b, eos: request_body(b, end_of_stream=eos), bodies, st.booleans()),
    st.builds(lambda: request_trailers({"t": "1"})),
    st.builds(response_headers, st.sampled_from([200, 500])),
    st.just(pb.ProcessingRequest()),  # no oneof set at all
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(messages, max_size=8))
def test_any_message_sequence_gets_answers_and_leaks_nothing(picker: ThreadedPicker, msgs):
    out = picker.exchange(msgs, timeout_s=10)
    for resp in out:
        kind = resp.WhichOneof("response")
        assert kind is not None
        if kind == "immediate_response":
            assert 400 <= resp.immediate_response.status.code < 600
            assert resp.immediate_response.status.code != 500, "an internal error is a bug"
        dest = destination(resp)
        if dest is not None:
            # Whatever the client sent, only the picker's endpoints are ever named.
            assert dest in ENDPOINTS
    assert picker.call(lambda: picker.app.router.inflight.total()) == 0
    # And the picker still routes a well-formed request afterwards.
    good = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    again = picker.exchange(
        [request_headers(post("/v1/chat/completions")), *body_chunks(good)], timeout_s=10
    )
    assert destination(again[0]) in ENDPOINTS
