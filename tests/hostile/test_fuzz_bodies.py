"""Hostile bodies beyond tests/requests/test_properties.py: Anthropic Messages and OpenAI
Responses shapes with media blocks (sniffed from random bytes behind real magic numbers),
precise keys (tokenizer + chat template) on top, and, through the real gRPC server, bodies
that are deeply nested, larger than the limit, split at random, or cut off mid-stream.

Each yields a routed decision or a clean 4xx; the picker keeps serving and its in-flight
counters return to zero. `bench/fuzz.py` runs the same properties with a larger budget."""

from __future__ import annotations

import base64
import itertools
import threading

import grpc
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc import protocol
from extproc.errors import ExtprocError
from extproc.hashing.tokenizer import PreciseKeys, PreciseSettings
from extproc.requests import ParseSettings, parse_request
from extproc.server import wire
from extproc.stack import SIM_TOKENIZER_DIR
from extproc.testing import body_chunks, destination, post, request_body, request_headers
from tests.hostile.conftest import ENDPOINTS, ThreadedPicker
from tests.requests import images

pb = wire.pb
BUDGET = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
PARSE = ParseSettings(max_blocks=64)
PRECISE = PreciseKeys.from_settings(
    PreciseSettings(
        tokenizer_dir=str(SIM_TOKENIZER_DIR), model="tiny", block_size=16, image_token="<|pad|>"
    )
)
MAGIC = [b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF89a", b"RIFF", b"BM", b"\x00\x00\x00"]

media_bytes = st.one_of(
    st.builds(lambda m, rest: m + rest, st.sampled_from(MAGIC), st.binary(max_size=64)),
    st.sampled_from([images.png(16, 16), images.jpeg(8, 8), images.png(70_000, 70_000)]),
)
b64 = st.one_of(media_bytes.map(lambda b: base64.b64encode(b).decode()), st.text(max_size=12))
text = st.text(max_size=40)
roles = st.sampled_from(["user", "assistant", "system", "tool", "developer", ""]) | text

anthropic_blocks = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries(
        {
            "type": st.just("image"),
            "source": st.one_of(
                st.fixed_dictionaries(
                    {
                        "type": st.just("base64"),
                        "media_type": st.sampled_from(["image/png", "image/jpeg", "x"]),
                        "data": b64,
                    }
                ),
                st.fixed_dictionaries(
                    {"type": st.just("url"), "url": st.just("https://example.com/a.png")}
                ),
                st.fixed_dictionaries({"type": text}),
            ),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("tool_use"), "id": text, "name": text, "input": st.just({"a": 1})}
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_result"),
            "tool_use_id": text,
            "content": text
            | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2),
        }
    ),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": text}),
    st.fixed_dictionaries({"type": text}),
)
anthropic_bodies = st.fixed_dictionaries(
    {
        "model": st.just("m") | text,
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": roles, "content": text | st.lists(anthropic_blocks, max_size=4)}
            ),
            max_size=4,
        ),
    },
    optional={
        "system": text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text})),
        "max_tokens": st.integers(-1, 10**6),
        "stream": st.booleans(),
    },
)
responses_parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("input_text"), "text": text}),
    st.fixed_dictionaries({"type": st.just("output_text"), "text": text}),
    st.fixed_dictionaries(
        {
            "type": st.just("input_image"),
            "image_url": b64.map(lambda d: f"data:image/png;base64,{d}") | text,
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("input_audio"),
            "input_audio": st.fixed_dictionaries(
                {"data": st.just(base64.b64encode(images.wav(0.1)).decode()) | b64, "format": text}
            ),
        }
    ),
    st.fixed_dictionaries({"type": text}),
)
responses_items = st.one_of(
    st.fixed_dictionaries(
        {"role": roles, "content": text | st.lists(responses_parts, max_size=3)},
        optional={"type": st.just("message")},
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call"), "call_id": text, "name": text, "arguments": text}
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": text, "output": text}
    ),
)
responses_bodies = st.fixed_dictionaries(
    {"model": st.just("m") | text},
    optional={
        "input": text | st.lists(responses_items, max_size=4),
        "instructions": text,
        "cache_salt": text,
    },
)


def answer(path: str, body: dict) -> None:
    """Parse, then key precisely: an InferenceRequest or an ExtprocError (a 4xx), nothing
    else; and never a 400 quoting the body back."""
    raw = orjson.dumps(body)
    try:
        req = parse_request(path, {}, raw, PARSE)
        PRECISE.block_keys(req)
    except ExtprocError as err:
        assert 400 <= err.status < 500
        assert len(err.message) < 300


@BUDGET
@given(anthropic_bodies)
def test_any_anthropic_body_gives_a_request_or_a_4xx(body: dict) -> None:
    answer("/v1/messages", body)


@BUDGET
@given(responses_bodies)
def test_any_responses_body_gives_a_request_or_a_4xx(body: dict) -> None:
    answer("/v1/responses", body)


# -- through the real gRPC server -------------------------------------------------------


def immediate_status(out: list[pb.ProcessingResponse]) -> int | None:
    for resp in out:
        if resp.WhichOneof("response") == "immediate_response":
            return resp.immediate_response.status.code
    return None


def leaks_nothing(picker: ThreadedPicker) -> None:
    assert picker.call(lambda: picker.app.router.inflight.total()) == 0
    good = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    again = picker.exchange([request_headers(post("/v1/chat/completions")), *body_chunks(good)])
    assert destination(again[0]) in ENDPOINTS


def chunked(body: bytes, cuts: list[int]) -> list[pb.ProcessingRequest]:
    points = sorted({c % (len(body) + 1) for c in cuts} | {0, len(body)})
    pieces = [body[a:b] for a, b in itertools.pairwise(points)] or [b""]
    return [request_body(p, end_of_stream=i == len(pieces) - 1) for i, p in enumerate(pieces)]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.sampled_from(["/v1/chat/completions", "/v1/messages", "/v1/responses"]),
    st.lists(st.integers(0, 10_000), max_size=6),
)
def test_a_body_split_anywhere_routes_the_same(picker: ThreadedPicker, path: str, cuts) -> None:
    key = "input" if path == "/v1/responses" else "messages"
    content = [{"role": "user", "content": "split me " * 40}]
    body = orjson.dumps({"model": "m", key: content if key == "messages" else "split me " * 40})
    whole = picker.exchange([request_headers(post(path)), *body_chunks(body)])
    split = picker.exchange([request_headers(post(path)), *chunked(body, cuts)])
    assert destination(whole[0]) in ENDPOINTS
    assert destination(split[0]) in ENDPOINTS
    assert picker.call(lambda: picker.app.router.inflight.total()) == 0


def test_deeply_nested_bodies_get_a_400_and_the_picker_keeps_serving(picker: ThreadedPicker):
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/responses"):
        for opener, closer in (("[", "]"), ('{"a":', "}")):
            # As deep as fits under the 200 KB limit (tens of thousands of levels).
            body = (opener * (190_000 // len(opener)) + closer * 10).encode()
            out = picker.exchange([request_headers(post(path)), *body_chunks(body)])
            assert immediate_status(out) == 400, (path, opener)
    leaks_nothing(picker)


def test_a_body_past_the_limit_is_refused_before_it_ends(picker: ThreadedPicker):
    """413 while the body is still open: 256 KB sent (limit 200 KB), no end_of_stream, and
    the stream held open until the answer comes. A picker that waited for the whole body
    would never answer."""
    answered = threading.Event()

    def messages():
        yield request_headers(post("/v1/chat/completions"))
        for _ in range(4):
            yield request_body(b"x" * 65_536, end_of_stream=False)
        answered.wait(10)  # the client keeps the body open until the picker has answered

    with grpc.insecure_channel(picker.target) as ch:
        call = ch.stream_stream(
            protocol.EXT_PROC_METHOD,
            request_serializer=pb.ProcessingRequest.SerializeToString,
            response_deserializer=pb.ProcessingResponse.FromString,
        )
        responses = call(messages(), timeout=20)
        first = next(iter(responses))
        answered.set()
        responses.cancel()
    assert first.immediate_response.status.code == 413
    leaks_nothing(picker)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.integers(1, 6), st.integers(1, 4000))
def test_a_body_cut_off_mid_stream_ends_cleanly(picker: ThreadedPicker, chunks: int, size: int):
    """The proxy half-closes after some chunks, none with end_of_stream (client gone)."""
    msgs = [request_headers(post("/v1/messages"))]
    msgs += [request_body(b'{"model": "m", "messages": [', end_of_stream=False)]
    msgs += [request_body(b"a" * size, end_of_stream=False) for _ in range(chunks - 1)]
    out = picker.exchange(msgs)
    for resp in out:
        assert resp.WhichOneof("response") is not None
    status = immediate_status(out)
    assert status is None or 400 <= status < 500
    leaks_nothing(picker)


def test_a_content_length_of_unicode_digits_is_not_an_internal_error(picker: ThreadedPicker):
    """Regression (found by bench/fuzz.py): '²' passed str.isdigit() and then failed int(),
    answering 500. Envoy's codec would refuse it first; the picker must not depend on that."""
    for value in ("²", "٣", "1²", "+5", "-1", " 7"):
        out = picker.exchange(
            [
                request_headers(post("/v1/chat/completions", {"content-length": value})),
                *body_chunks(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'),
            ],
        )
        assert immediate_status(out) != 500, value
        assert destination(out[0]) in ENDPOINTS, value
    leaks_nothing(picker)
