"""parse_request: every API, the headers that matter, and the 400s."""

from __future__ import annotations

import base64

import msgspec
import orjson
import pytest

from extproc.core import Api, Modality
from extproc.errors import BadRequest
from extproc.requests import ParseSettings, parse_request
from tests.requests import images

SETTINGS = ParseSettings()
LONG = "The router sends the prefix to the server today. " * 40  # ~2 KB, 7 blocks


def parse(path: str, body: object, headers: dict[str, str] | None = None, settings=SETTINGS):
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return parse_request(path, headers or {}, raw, settings)


def chat(*messages: dict, **extra: object) -> dict:
    return {"model": "m", "messages": list(messages), **extra}


def user(content: object) -> dict:
    return {"role": "user", "content": content}


def bad(path: str, body: object, headers: dict[str, str] | None = None) -> str:
    with pytest.raises(BadRequest) as info:
        parse(path, body, headers)
    return info.value.message


# --- the APIs -------------------------------------------------------------------------


def test_completions_string_prompt_fills_every_field() -> None:
    req = parse(
        "/v1/completions",
        {"model": "m", "prompt": LONG, "stream": True},
        {"x-request-id": "rid-1"},
    )
    assert (req.api, req.model, req.stream, req.request_id) == (Api.COMPLETIONS, "m", True, "rid-1")
    assert req.body_bytes > len(LONG)
    assert len(req.block_keys) == len(LONG) // SETTINGS.block_bytes
    assert req.prompt_tokens == len(LONG) // 4


def test_completions_token_ids_count_exactly() -> None:
    req = parse("/v1/completions", {"model": "m", "prompt": list(range(1000))})
    assert req.prompt_tokens == 1000
    assert req.prompt is not None and req.prompt.completion == tuple(range(1000))
    assert len(req.block_keys) == (1000 * 4 + 2) // SETTINGS.block_bytes


def test_completions_batch_keys_from_first_prompt_tokens_from_all() -> None:
    first = parse("/v1/completions", {"model": "m", "prompt": LONG})
    batch = parse("/v1/completions", {"model": "m", "prompt": [LONG, "x" * 400]})
    assert batch.block_keys == first.block_keys
    assert batch.prompt_tokens == first.prompt_tokens + 100
    ids = parse("/v1/completions", {"model": "m", "prompt": [[1, 2, 3], [4, 5]]})
    assert ids.prompt_tokens == 5


def test_embeddings_accept_the_completions_input_shapes() -> None:
    req = parse("/v1/embeddings", {"model": "e", "input": ["a" * 40, "b" * 40]})
    assert (req.api, req.prompt_tokens) == (Api.EMBEDDINGS, 20)


def test_chat_with_tools_calls_and_tool_results() -> None:
    body = chat(
        {"role": "system", "content": LONG},
        user("what is the weather?"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "developer", "name": "ops", "content": [{"type": "text", "text": "be brief"}]},
        tools=[{"type": "function", "function": {"name": "weather", "parameters": {}}}],
    )
    req = parse("/v1/chat/completions", body)
    assert req.api is Api.CHAT and req.prompt is not None
    assert [m.role for m in req.prompt.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "developer",
    ]
    assert req.prompt.messages[2].tool_calls and req.prompt.messages[3].tool_call_id == "c1"
    assert len(req.prompt.tools) == 1
    assert req.block_keys and req.prompt_tokens > len(LONG) // 4


def test_chat_inline_image_is_hashed_sized_and_priced() -> None:
    png = images.png(1280, 720, payload=100)
    req = parse(
        "/v1/chat/completions",
        chat(
            user(
                [
                    {"type": "text", "text": "describe"},
                    {"type": "image_url", "image_url": {"url": images.data_uri(png)}},
                ]
            )
        ),
    )
    (item,) = req.media
    assert (item.modality, item.width, item.height, item.is_remote) == (
        Modality.IMAGE,
        1280,
        720,
        False,
    )
    assert item.tokens == -(-1280 * 720 // 784)
    import blake3

    assert item.content_hash == blake3.blake3(png).hexdigest()
    # The image weighs its token cost in the prefix stream.
    assert len(req.block_keys) >= item.tokens * 4 // SETTINGS.block_bytes


def test_model_family_picks_the_image_estimator() -> None:
    png = images.data_uri(images.png(1280, 720))
    part = user([{"type": "image_url", "image_url": {"url": png}}])
    qwen3 = parse("/v1/chat/completions", {"model": "Qwen/Qwen3-VL-8B", "messages": [part]})
    llava = parse("/v1/chat/completions", {"model": "llava-hf/llava-1.5-7b", "messages": [part]})
    assert qwen3.media[0].tokens == 900
    assert llava.media[0].tokens == 576


def test_same_image_twice_counts_once_for_affinity_twice_for_cost() -> None:
    part = {"type": "image_url", "image_url": images.data_uri(images.png(64, 64))}
    one = parse("/v1/chat/completions", chat(user([part])))
    two = parse("/v1/chat/completions", chat(user([part, part])))
    assert len(two.media) == 1
    assert two.prompt_tokens == one.prompt_tokens + one.media[0].tokens


def test_remote_image_identity_is_its_normalized_url_priced_at_default_resolution() -> None:
    a = parse(
        "/v1/chat/completions",
        chat(
            user([{"type": "image_url", "image_url": {"url": "HTTPS://Example.COM:443/a.png#x"}}])
        ),
    )
    b = parse(
        "/v1/chat/completions",
        chat(user([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}])),
    )
    assert a.media == b.media and a.media[0].is_remote
    assert (a.media[0].width, a.media[0].height) == (1280, 720)


def test_unsniffable_inline_image_gets_the_default_resolution() -> None:
    req = parse(
        "/v1/chat/completions",
        chat(user([{"type": "image_url", "image_url": {"url": images.data_uri(b"II*\x00tiff")}}])),
    )
    assert (req.media[0].width, req.media[0].height) == (1280, 720)


def test_audio_from_wav_header_and_bytes_fallback() -> None:
    wav = base64.b64encode(images.wav(4.0)).decode()
    req = parse(
        "/v1/chat/completions",
        chat(user([{"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}])),
    )
    assert req.media[0].modality is Modality.AUDIO and req.media[0].tokens == 100
    mp3 = base64.b64encode(b"ID3" + bytes(32_000)).decode()
    req = parse(
        "/v1/chat/completions",
        chat(user([{"type": "input_audio", "input_audio": {"data": mp3, "format": "mp3"}}])),
    )
    assert req.media[0].tokens == 51  # 32003 bytes at 16000 B/s -> 2.0002 s -> ceil(50.004)
    req = parse(
        "/v1/chat/completions",
        chat(user([{"type": "audio_url", "audio_url": {"url": "https://a/b.mp3"}}])),
    )
    assert req.media[0].tokens == 750 and req.media[0].is_remote


def test_video_priced_from_headers_or_defaults() -> None:
    body = chat(user([{"type": "video_url", "video_url": {"url": "https://v/clip.mp4"}}]))
    default = parse("/v1/chat/completions", body)
    # 10 s * 2 fps = 20 frames / temporal patch 2 = 10 frames of 640x360 (294 tokens)
    assert default.media[0].tokens == 10 * 294
    headers = {"x-llm-d-video-duration-seconds": "60", "x-llm-d-video-resolution": "1280x720"}
    long = parse("/v1/chat/completions", body, headers)
    assert long.media[0].tokens == min(60 * 1176, 16_384)
    assert (long.media[0].width, long.media[0].height) == (1280, 720)


@pytest.mark.parametrize(
    "header,value",
    [
        ("x-llm-d-video-fps", "fast"),
        ("x-llm-d-video-duration-seconds", "-1"),
        ("x-llm-d-video-duration-seconds", "nan"),
        ("x-llm-d-video-resolution", "720p"),
    ],
)
def test_bad_video_headers_get_400_naming_the_header(header: str, value: str) -> None:
    body = chat(user([{"type": "video_url", "video_url": {"url": "https://v/clip.mp4"}}]))
    assert bad("/v1/chat/completions", body, {header: value}).startswith(header)


def test_responses_string_items_images_and_function_calls() -> None:
    req = parse("/v1/responses", {"model": "m", "input": "hi", "instructions": "be kind"})
    assert req.api is Api.RESPONSES and [m.role for m in req.prompt.messages] == ["system", "user"]
    body = {
        "model": "m",
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "look"},
                    {"type": "input_image", "image_url": images.data_uri(images.gif(10, 20))},
                ],
            },
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "ok"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "done"}],
            },
        ],
        "stream": True,
    }
    req = parse("/v1/responses", body)
    assert [m.role for m in req.prompt.messages] == ["user", "assistant", "tool", "assistant"]
    assert (req.media[0].width, req.media[0].height) == (10, 20) and req.stream


def test_anthropic_messages_system_images_tools() -> None:
    jpeg = base64.b64encode(images.jpeg(800, 600)).decode()
    body = {
        "model": "claude-x",
        "system": [{"type": "text", "text": "sys"}],
        "max_tokens": 5,
        "tools": [{"name": "f", "input_schema": {}}],
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/jpeg", "data": jpeg},
                    },
                    {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
                    {"type": "text", "text": "what?"},
                ],
            },
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "42"},
                    {"type": "text", "text": "thanks"},
                ],
            },
        ],
    }
    req = parse("/v1/messages", body)
    assert req.api is Api.MESSAGES and req.model == "claude-x"
    assert [m.role for m in req.prompt.messages] == ["system", "user", "assistant", "tool", "user"]
    assert [(m.width, m.height, m.is_remote) for m in req.media] == [
        (800, 600, False),
        (1280, 720, True),
    ]


# --- headers, salt, adapters ------------------------------------------------------------


def test_model_rewrite_header_wins_and_changes_keys() -> None:
    body = {"model": "m", "prompt": LONG}
    plain = parse("/v1/completions", body)
    rewritten = parse("/v1/completions", body, {"x-llm-d-model-name-rewrite": "other"})
    assert rewritten.model == "other"
    assert set(plain.block_keys).isdisjoint(rewritten.block_keys)


def test_cache_salt_and_adapter_separate_the_key_space() -> None:
    settings = ParseSettings(adapters={"sql-lora": "m"})
    plain = parse("/v1/completions", {"model": "m", "prompt": LONG}, settings=settings)
    salted = parse(
        "/v1/completions", {"model": "m", "prompt": LONG, "cache_salt": "t1"}, settings=settings
    )
    lora = parse("/v1/completions", {"model": "sql-lora", "prompt": LONG}, settings=settings)
    assert (
        salted.cache_salt == "t1" and lora.lora_adapter == "sql-lora" and plain.lora_adapter is None
    )
    assert len({plain.block_keys[0], salted.block_keys[0], lora.block_keys[0]}) == 3


def test_paths_with_prefixes_queries_and_fallback_headers() -> None:
    body = {"model": "m", "messages": [user("hi")]}
    assert parse("/openai/v1/chat/completions?x=1", body).api is Api.CHAT
    assert parse("/v1/chat/completions/", body).api is Api.CHAT
    req = parse("/rewritten", body, {"x-envoy-original-path": "/v1/chat/completions"})
    assert req.api is Api.CHAT and req.path == "/rewritten"


# --- prefix behaviour -----------------------------------------------------------------


def test_shared_conversation_prefix_shares_leading_keys() -> None:
    turn1 = parse(
        "/v1/chat/completions", chat({"role": "system", "content": LONG}, user("first question"))
    )
    turn2 = parse(
        "/v1/chat/completions",
        chat(
            {"role": "system", "content": LONG},
            user("first question"),
            {"role": "assistant", "content": LONG},
            user("next"),
        ),
    )
    shared = len(LONG) // SETTINGS.block_bytes
    assert turn2.block_keys[:shared] == turn1.block_keys[:shared]
    assert len(turn2.block_keys) > len(turn1.block_keys)


def test_an_early_change_changes_every_later_key() -> None:
    a = parse("/v1/chat/completions", chat(user(LONG + LONG)))
    b = parse("/v1/chat/completions", chat(user("X" + LONG[1:] + LONG)))
    assert set(a.block_keys).isdisjoint(b.block_keys)


def test_block_cap_bounds_the_keys_not_the_estimate() -> None:
    settings = ParseSettings(max_blocks=4)
    req = parse("/v1/completions", {"model": "m", "prompt": "x" * 100_000}, settings=settings)
    assert len(req.block_keys) == 4 and req.prompt_tokens == 25_000


# --- bad input ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body,field",
    [
        ({"messages": []}, "model"),
        ({"model": 7, "messages": []}, "model"),
        ({"model": "", "messages": []}, "model"),
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": [{"content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [user(5)]}, "messages[0].content"),
        (
            {"model": "m", "messages": [user([{"type": "SECRET-TYPE"}])]},
            "messages[0].content[0].type",
        ),
        ({"model": "m", "messages": [user([{"type": "text"}])]}, "messages[0].content[0].text"),
        ({"model": "m", "messages": [], "stream": "yes"}, "stream"),
    ],
)
def test_wrong_json_types_get_400_naming_the_field(body: dict, field: str) -> None:
    message = bad("/v1/chat/completions", body)
    assert message.startswith(f"{field}:")
    assert "SECRET" not in message


@pytest.mark.parametrize(
    "url,reason",
    [
        ("data:image/png;base64,@@@SECRET@@@", "invalid base64"),
        (
            "data:image/png;base64," + base64.b64encode(images.png(100_000, 100_000)).decode(),
            "out of range",
        ),
        (
            "data:image/png;base64," + base64.b64encode(images.png(10, 10)[:18]).decode(),
            "truncated",
        ),
        ("no-scheme-SECRET", "data URI or a URL"),
        ("http:///nohost", "without a host"),
        ("data:image/png;base64", "malformed data URI"),
    ],
)
def test_bad_media_gets_400_naming_the_field(url: str, reason: str) -> None:
    body = chat(user([{"type": "image_url", "image_url": {"url": url}}]))
    message = bad("/v1/chat/completions", body)
    assert message.startswith("messages[0].content[0].image_url.url:") and reason in message
    assert "SECRET" not in message


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not json",
        b"[1, 2]",
        b'{"model": "m", "messages": [' * 2000 + b"]" * 2000 + b"}",
        b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
    ],
    ids=["empty", "text", "array", "deep", "non-utf8"],
)
def test_malformed_bodies_on_known_paths_get_400(raw: bytes) -> None:
    with pytest.raises(BadRequest) as info:
        parse_request("/v1/chat/completions", {}, raw, SETTINGS)
    assert info.value.status == 400


def test_unsupported_responses_item_type_gets_400() -> None:
    message = bad("/v1/responses", {"model": "m", "input": [{"type": "web_search_call"}]})
    assert message == "input[0].type: unsupported input item type"


def test_completions_prompt_of_mixed_types_gets_400() -> None:
    assert bad("/v1/completions", {"model": "m", "prompt": [1, "a"]}).startswith("prompt:")
    assert bad("/v1/completions", {"model": "m", "prompt": [-1]}).startswith("prompt:")


def test_unknown_paths_route_without_keys_whatever_the_body() -> None:
    for raw in (b"\x00\x01binary", b"", b'{"model": "m", "prompt": "hi"}', b"[" * 100_000):
        req = parse_request("/v1/audio/transcriptions", {"x-request-id": "r"}, raw, SETTINGS)
        assert (req.api, req.block_keys, req.request_id) == (Api.UNKNOWN, (), "r")
    req = parse_request("/metrics-ish", {}, b'{"model": "m"}', SETTINGS)
    assert req.model == "m"


def test_settings_defaults_and_strict_decoding() -> None:
    assert ParseSettings().block_bytes == 256
    decoded = msgspec.json.decode(b'{"max_blocks": 8, "adapters": {"a": "m"}}', type=ParseSettings)
    assert decoded.max_blocks == 8
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"max_blokcs": 8}', type=ParseSettings)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"block_tokens": 0}', type=ParseSettings)


def test_lone_surrogate_escapes_never_crash() -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800 x"}]}'
    try:
        req = parse_request("/v1/chat/completions", {}, raw, SETTINGS)
    except BadRequest as exc:
        assert exc.message.startswith("body") or exc.message.startswith("messages")
    else:
        assert req.model == "m"
    with pytest.raises(BadRequest, match=r"^(model|body)"):
        parse_request("/v1/chat/completions", {}, b'{"model": "\\udc00", "messages": []}', SETTINGS)
    assert parse_request("/x", {}, b'{"model": "\\udc00"}', SETTINGS).model == ""


def test_key_block_tokens_is_the_same_with_the_geometry_pinned_at_its_own_width() -> None:
    # The unpinned shortcut (block_tokens as is) must agree with the scaled formula.
    for block_tokens in (1, 16, 64, 1000):
        for bpt in (1, 3, 4, 7):
            free = ParseSettings(block_tokens=block_tokens, bytes_per_token=bpt)
            pinned = ParseSettings(
                block_tokens=block_tokens, bytes_per_token=bpt, key_bytes_per_token=bpt
            )
            assert free.key_block_tokens == pinned.key_block_tokens == block_tokens
    scaled = ParseSettings(block_tokens=64, bytes_per_token=2, key_bytes_per_token=4)
    assert scaled.key_block_tokens == 128


# --- the output cap -------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body,cap",
    [
        ("/v1/chat/completions", chat(user("hi"), max_tokens=40), 40),
        # vLLM: max_completion_tokens wins over the older max_tokens.
        ("/v1/chat/completions", chat(user("hi"), max_tokens=40, max_completion_tokens=7), 7),
        ("/v1/chat/completions", chat(user("hi"), max_completion_tokens=12), 12),
        ("/v1/chat/completions", chat(user("hi")), None),
        ("/v1/chat/completions", chat(user("hi"), max_tokens=None), None),
        ("/v1/chat/completions", chat(user("hi"), max_tokens=0), None),  # the engine's 400
        ("/v1/chat/completions", chat(user("hi"), max_tokens=64.0), 64),
        ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 16}, 16),
        ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 300}, 300),
        ("/v1/responses", {"model": "m", "input": "hi"}, None),
        ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": [user("hi")]}, 5),
        ("/v1/embeddings", {"model": "m", "input": "hi"}, None),
    ],
)
def test_the_output_cap_is_read_from_every_request_shape(path: str, body: dict, cap) -> None:
    assert parse(path, body).max_output_tokens == cap


def test_a_non_numeric_output_cap_gets_400_naming_the_field() -> None:
    assert bad("/v1/chat/completions", chat(user("hi"), max_tokens="many")).startswith(
        "max_tokens:"
    )
    assert bad("/v1/messages", {"model": "m", "max_tokens": [1], "messages": []}).startswith(
        "max_tokens:"
    )
    overflow = b'{"model": "m", "messages": [], "max_tokens": 1e999}'  # not a finite number
    assert bad("/v1/chat/completions", overflow).startswith("max_tokens:")
    huge = b'{"model": "m", "messages": [], "max_tokens": 99999999999999999999999999}'
    assert parse("/v1/chat/completions", huge).max_output_tokens == 10**26 - 1
