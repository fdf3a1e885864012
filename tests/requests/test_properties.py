"""Whatever arrives, parse_request answers an InferenceRequest or a BadRequest: nothing
else escapes, and a 400 never quotes the body."""

from __future__ import annotations

import base64
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.core import InferenceRequest
from extproc.errors import BadRequest
from extproc.requests import ParseSettings, parse_request
from tests.requests import images

SETTINGS = ParseSettings(max_blocks=64)
PATHS = st.sampled_from(
    [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/embeddings",
        "/v1/messages",
        "/v1/models",
        "/",
        "",
    ]
)
BUDGET = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
media_urls = st.sampled_from(
    [
        images.data_uri(images.png(32, 32)),
        images.data_uri(images.jpeg(32, 32)[:9]),
        images.data_uri(images.png(100_000, 100_000)),
        "data:image/png;base64,%%%",
        "https://example.com/x.png",
        "ftp://h/x",
        "not a url",
        "http://[::1",
    ]
)
parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=30)}),
    st.fixed_dictionaries(
        {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": media_urls})}
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("input_audio"),
            "input_audio": st.fixed_dictionaries(
                {
                    "data": st.sampled_from(
                        [base64.b64encode(images.wav(0.1)).decode(), "!!", "UklGRg=="]
                    )
                }
            ),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("video_url"), "video_url": st.fixed_dictionaries({"url": media_urls})}
    ),
    st.fixed_dictionaries({"type": st.text(max_size=10)}),
    json_values,
)
messages = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "system", "tool"]) | json_values,
        "content": st.text(max_size=50) | st.lists(parts, max_size=4) | json_values,
    },
)
bodies = st.fixed_dictionaries(
    {"model": st.text(max_size=10) | json_values},
    optional={
        "messages": st.lists(messages, max_size=4) | json_values,
        "prompt": st.text(max_size=50)
        | st.lists(st.integers(-5, 2**33), max_size=10)
        | json_values,
        "input": st.text(max_size=50) | st.lists(messages, max_size=3) | json_values,
        "stream": st.booleans() | json_values,
        "cache_salt": st.text(max_size=5) | json_values,
        "tools": st.lists(json_values, max_size=2) | json_values,
        "system": st.text(max_size=20) | json_values,
    },
)
headers = st.fixed_dictionaries(
    {},
    optional={
        "x-request-id": st.text(max_size=8),
        "x-llm-d-video-fps": st.sampled_from(["30", "0", "x", "1e400", "inf"]),
        "x-llm-d-video-resolution": st.sampled_from(["1x1", "0x0", "12", "\u0661x1"]),
        "x-llm-d-model-name-rewrite": st.text(max_size=5),
    },
)


def _answer(path: str, hdrs: dict[str, str], raw: bytes) -> None:
    try:
        req = parse_request(path, hdrs, raw, SETTINGS)
    except BadRequest as exc:
        assert exc.status == 400 and exc.message
        assert len(exc.message) < 200
        return
    assert isinstance(req, InferenceRequest)
    assert len(req.block_keys) <= SETTINGS.max_blocks
    assert req.prompt_tokens >= 0


@BUDGET
@given(PATHS, st.binary(max_size=300))
def test_any_bytes_give_a_request_or_a_400(path: str, raw: bytes) -> None:
    _answer(path, {}, raw)


@BUDGET
@given(PATHS, headers, bodies)
def test_any_json_shaped_body_gives_a_request_or_a_400(path: str, hdrs: dict, body: dict) -> None:
    _answer(path, hdrs, json.dumps(body).encode())


@BUDGET
@given(PATHS, bodies, st.data())
def test_truncated_or_corrupted_bodies_give_a_request_or_a_400(path: str, body: dict, data) -> None:
    raw = bytearray(json.dumps(body).encode())
    i = data.draw(st.integers(0, len(raw)))
    if data.draw(st.booleans()):
        del raw[i:]
    elif i < len(raw):
        raw[i] = data.draw(st.integers(0, 255))
    _answer(path, {}, bytes(raw))


@pytest.mark.parametrize(
    ("path", "field"), [("/v1/completions", b"prompt"), ("/v1/embeddings", b"input")]
)
def test_invalid_utf8_inside_a_prompt_is_a_400(path: str, field: bytes) -> None:
    """The prompt is kept raw by the body's decoder (its shape is decided later), which
    checks its JSON but not its strings' UTF-8: found by the property above (a 500)."""
    raw = b'{"model": "m", "' + field + b'": "\\ud800\\udc00\x80"}'
    # The same message as a kept-raw field's (requests/raw.not_utf8).
    with pytest.raises(BadRequest, match=f"^{field.decode()}: must be valid UTF-8 JSON$"):
        parse_request(path, {}, raw, SETTINGS)


_CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}%s]%s}'
_BAD = b'"\x80"'  # a JSON string holding a byte no UTF-8 text has


@pytest.mark.parametrize(
    ("path", "raw", "field"),
    [
        ("/v1/chat/completions", _CHAT % (b"", b', "tools": [{"a": %s}]' % _BAD), "tools[0]"),
        ("/v1/chat/completions", _CHAT % (b"", b', "priority": %s' % _BAD), "priority"),
        (
            "/v1/chat/completions",
            _CHAT % (b', {"role": "assistant", "tool_calls": [{"f": %s}]}' % _BAD, b""),
            "messages[1].tool_calls[0]",
        ),
        (
            "/v1/messages",
            _CHAT % (b"", b', "tools": [{"a": %s}], "max_tokens": 5' % _BAD),
            "tools[0]",
        ),
        (
            "/v1/messages",
            b'{"model": "m", "max_tokens": 5, "messages": [{"role": "assistant", "content": '
            b'[{"type": "tool_use", "id": "t", "name": "f", "input": {"a": %s}}]}]}' % _BAD,
            "messages[0].content[0].input",
        ),
    ],
)
def test_invalid_utf8_in_json_kept_raw_is_a_400(path: str, raw: bytes, field: str) -> None:
    """Tools, tool calls, a tool use's input and the client's priority are kept raw (hashed
    or forwarded as they came): their strings' UTF-8 is checked at parse time, or engine
    priority's body edit met it as an exception after the decision."""
    with pytest.raises(BadRequest, match=f"^{re.escape(field)}: must be valid UTF-8 JSON$"):
        parse_request(path, {}, raw, SETTINGS)


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(["{", "[", '{"a":']), st.integers(100, 50_000))
def test_deep_nesting_is_bounded(opener: str, depth: int) -> None:
    raw = b'{"model": "m", "messages": [], "x": ' + opener.encode() * depth + b"1"
    _answer("/v1/chat/completions", {}, raw)
    _answer("/unknown", {}, raw)
