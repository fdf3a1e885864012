"""The door for client JSON: (path, headers, body) -> `InferenceRequest`, with the model,
the ordered prompt, media items, a token estimate and approximate prefix block keys.

Known API path + malformed body -> `BadRequest` naming the field. Unknown path -> an
`Api.UNKNOWN` request (routed by load, no block keys), whatever the body holds.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from extproc.core import Api, InferenceRequest, MediaItem, Prompt
from extproc.errors import BadRequest
from extproc.hashing.estimate import text_tokens
from extproc.hashing.prefix import approx_seed, block_keys, canonical_stream
from extproc.protocol import MODEL_REWRITE_HEADER, PATH_FALLBACK_HEADERS, REQUEST_ID_HEADER
from extproc.requests import anthropic, openai
from extproc.requests.media import MediaResolver
from extproc.requests.raw import raw_json
from extproc.requests.settings import ParseSettings

# When a route rewrote :path before us, the client's path survives in one of these.
_PATH_FALLBACK_HEADERS = (":path", *PATH_FALLBACK_HEADERS)

# Suffixes, so prefixed deployments (`/openai/v1/chat/completions`) match too; chat first,
# as it also ends in /completions.
_ROUTES = (
    ("/chat/completions", Api.CHAT),
    ("/completions", Api.COMPLETIONS),
    ("/responses", Api.RESPONSES),
    ("/embeddings", Api.EMBEDDINGS),
    ("/messages", Api.MESSAGES),
)


def api_for_path(path: str) -> Api:
    """The API a request path speaks (query string and trailing slash ignored)."""
    p = path.partition("?")[0].rstrip("/")
    for suffix, api in _ROUTES:
        if p.endswith(suffix):
            return api
    return Api.UNKNOWN


class _ModelOnly(msgspec.Struct):
    model: str = ""


_Converter = Callable[[Any, MediaResolver, ParseSettings], tuple[Prompt, int | None]]


def _chat(req: openai.ChatRequest, m: MediaResolver, s: ParseSettings) -> tuple[Prompt, None]:
    return openai.chat_prompt(req, m), None


def _responses(
    req: openai.ResponsesRequest, m: MediaResolver, s: ParseSettings
) -> tuple[Prompt, None]:
    return openai.responses_prompt(req, m), None


def _messages(
    req: anthropic.MessagesRequest, m: MediaResolver, s: ParseSettings
) -> tuple[Prompt, None]:
    return anthropic.messages_prompt(req, m), None


def _completions(
    req: openai.CompletionsRequest | openai.EmbeddingsRequest, m: MediaResolver, s: ParseSettings
) -> tuple[Prompt, int]:
    """A batch goes to one endpoint but each prompt is cached on its own: keys come from the
    first prompt, the token estimate from all of them."""
    if isinstance(req, openai.CompletionsRequest):
        field, value = "prompt", req.prompt
    else:
        field, value = "input", req.input
    inputs = openai.prompt_inputs(value, field)
    tokens = sum(
        text_tokens(x, s.bytes_per_token) if isinstance(x, str) else len(x) for x in inputs
    )
    special = req.add_special_tokens if isinstance(req, openai.CompletionsRequest) else None
    return Prompt(completion=inputs[0] if inputs else None, add_special_tokens=special), tokens


_APIS: Mapping[Api, tuple[msgspec.json.Decoder[Any], _Converter]] = {
    Api.CHAT: (msgspec.json.Decoder(openai.ChatRequest), _chat),
    Api.COMPLETIONS: (msgspec.json.Decoder(openai.CompletionsRequest), _completions),
    Api.RESPONSES: (msgspec.json.Decoder(openai.ResponsesRequest), _responses),
    Api.EMBEDDINGS: (msgspec.json.Decoder(openai.EmbeddingsRequest), _completions),
    Api.MESSAGES: (msgspec.json.Decoder(anthropic.MessagesRequest), _messages),
}
_MODEL_ONLY = msgspec.json.Decoder(_ModelOnly)


def parse_request(
    path: str,
    headers: Mapping[str, str],
    body: bytes,
    settings: ParseSettings,
    *,
    approximate_keys: bool = True,
) -> InferenceRequest:
    """Parse one request. `headers` have lower-case names. Raises `BadRequest` for a known
    API path whose body is malformed; never raises for an unknown path.

    `approximate_keys=False` (precise mode, where the tokenizer's keys replace them) skips
    the canonical stream and its hashing: `block_keys` is left empty."""
    request_id = headers.get(REQUEST_ID_HEADER, "")
    api = api_for_path(path)
    if api is Api.UNKNOWN:
        for name in _PATH_FALLBACK_HEADERS:
            if (alt := headers.get(name)) and (api := api_for_path(alt)) is not Api.UNKNOWN:
                break
    if api is Api.UNKNOWN:
        return InferenceRequest(
            request_id=request_id,
            path=path,
            model=headers.get(MODEL_REWRITE_HEADER) or _sniff_model(body),
            headers=headers,
            body_bytes=len(body),
        )

    decoder, convert = _APIS[api]
    try:
        decoded = decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise _bad_field(str(exc)) from None
    except msgspec.DecodeError:
        raise BadRequest("body: must be a JSON object in valid UTF-8") from None
    except RecursionError:
        raise BadRequest("body: nested too deeply") from None

    model = headers.get(MODEL_REWRITE_HEADER) or decoded.model
    priority = getattr(decoded, "priority", msgspec.UNSET)
    client_priority = priority is not msgspec.UNSET
    if isinstance(priority, msgspec.Raw):
        raw_json(priority, "priority")  # engine priority's body edit decodes the whole body
    if not model:
        raise BadRequest("model: must be a non-empty string")
    cache_salt = getattr(decoded, "cache_salt", None) or None
    _require_text(model, "model")
    if cache_salt is not None:
        _require_text(cache_salt, "cache_salt")
    base_model = settings.adapters.get(model)
    lora_adapter = model if base_model is not None else None
    base_model = base_model or model

    resolver = MediaResolver(settings, base_model, headers)
    prompt, tokens = convert(decoded, resolver, settings)
    if tokens is None:
        tokens = estimate_prompt_tokens(prompt, settings)
    keys: tuple[int, ...] = ()
    if approximate_keys:
        block_bytes = settings.block_bytes  # a property: computed once here
        stream = canonical_stream(prompt, settings.key_bpt, settings.max_blocks * block_bytes)
        keys = block_keys(stream, block_bytes, approx_seed(base_model, lora_adapter, cache_salt))
    return InferenceRequest(
        request_id=request_id,
        path=path,
        api=api,
        model=model,
        headers=headers,
        body_bytes=len(body),
        stream=bool(decoded.stream),
        prompt_tokens=tokens,
        block_keys=keys,
        block_tokens=settings.key_block_tokens,
        media=distinct_media(prompt),
        lora_adapter=lora_adapter,
        cache_salt=cache_salt,
        max_output_tokens=output_cap(decoded),
        client_priority=client_priority,
        prompt=prompt,
    )


def output_cap(decoded: Any) -> int | None:
    """The body's output-token cap, whichever field its API spells it with (chat:
    `max_completion_tokens`, else `max_tokens`; completions and Anthropic messages:
    `max_tokens`; responses: `max_output_tokens`). A value below 1 is the engine's to
    refuse: None here, as is a missing one."""
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = getattr(decoded, name, None)
        if value is not None:
            return int(value) if value >= 1 else None
    return None


def estimate_prompt_tokens(prompt: Prompt, settings: ParseSettings) -> int:
    """Text by `text_tokens`, media by their estimates (every occurrence: the engine
    processes each), tool JSON by its bytes, plus a fixed overhead per turn."""
    bpt = settings.bytes_per_token
    total = sum(-(-len(t) // bpt) for t in prompt.tools)
    total += settings.message_overhead_tokens * len(prompt.messages)
    # Once per turn of conversations hundreds of turns long: ASCII text inline, no
    # generator unless the turn has tool calls.
    for m in prompt.messages:
        for p in m.parts:
            if p.media is not None:
                total += p.media.tokens
            elif p.text.isascii():
                total += -(-len(p.text) // bpt)
            else:
                total += text_tokens(p.text, bpt)
        if m.tool_calls:
            total += sum(-(-len(c) // bpt) for c in m.tool_calls)
    return total


def estimate_media_tokens(prompt: Prompt) -> int:
    """The media part of `estimate_prompt_tokens` (every occurrence): what does not change
    with bytes-per-token, so calibration leaves it out of the characters it measures."""
    return sum(p.media.tokens for m in prompt.messages for p in m.parts if p.media is not None)


def distinct_media(prompt: Prompt) -> tuple[MediaItem, ...]:
    """Each asset once, in order of first appearance: a repeated image counts once for
    affinity."""
    seen: dict[str, MediaItem] = {}
    for m in prompt.messages:
        for p in m.parts:
            if p.media is not None and p.media.content_hash not in seen:
                seen[p.media.content_hash] = p.media
    return tuple(seen.values())


def _sniff_model(body: bytes) -> str:
    """Best-effort model of a body we do not understand; "" when there is none."""
    if body.lstrip()[:1] != b"{":
        return ""
    try:
        model = _MODEL_ONLY.decode(body).model
    except (msgspec.MsgspecError, RecursionError):
        return ""
    try:
        model.encode()
    except UnicodeEncodeError:
        return ""
    return model


def _require_text(value: str, field: str) -> None:
    try:
        value.encode()
    except UnicodeEncodeError:
        raise BadRequest(f"{field}: must be valid UTF-8 text") from None


_AT = re.compile(r"^(.*?)(?: - at `\$(.*)`)?$", re.DOTALL)
_MISSING = re.compile(r"^Object missing required field `(\w+)`$")
_EXPECTED = re.compile(r"^Expected `([^`]+)`(?:, got `([^`]+)`)?(.*)$")


def _bad_field(message: str) -> BadRequest:
    """A client-safe 400 from a msgspec validation message: the field path and what was
    wrong, never the offending value (msgspec quotes bad tag values)."""
    match = _AT.match(message)
    what, where = (match.group(1), match.group(2) or "") if match else ("", "")
    where = where.lstrip(".")
    if m := _MISSING.match(what):
        return BadRequest(f"{_join(where, m.group(1))}: required")
    if m := _EXPECTED.match(what):
        got = f", got {m.group(2)}" if m.group(2) else ""
        bound = m.group(3) if re.fullmatch(r"[\s<>=\d.-]*", m.group(3)) else ""
        return BadRequest(f"{where or 'body'}: expected {m.group(1)}{bound}{got}")
    if what.startswith("Invalid value"):
        return BadRequest(f"{where or 'body'}: unsupported value")
    return BadRequest(f"{where or 'body'}: invalid value")


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name
