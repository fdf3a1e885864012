"""OpenAI-style bodies (completions, chat completions, responses, embeddings) -> `Prompt`.

The structs declare only what routing reads; every other field is skipped by the decoder
without being built. Unknown content-part types fail the tagged unions: a 400. They are
untracked by the cycle collector (`gc=False`: decoded JSON holds no cycles), so a 200-turn
body adds nothing for the collector to walk.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from extproc.core import Message, Part, Prompt
from extproc.errors import BadRequest
from extproc.requests.media import MediaResolver, decode_base64
from extproc.requests.raw import not_utf8, raw_jsons

TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]


class _Url(msgspec.Struct, frozen=True, gc=False):
    url: str


class _InputAudio(msgspec.Struct, frozen=True, gc=False):
    data: str
    format: str = "wav"


class _Text(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="text"):
    text: str


class _ImageUrl(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="image_url"):
    image_url: str | _Url


class _InputAudioPart(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="input_audio"):
    input_audio: _InputAudio


class _AudioUrl(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="audio_url"):
    audio_url: str | _Url


class _VideoUrl(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="video_url"):
    video_url: str | _Url


class _Refusal(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="refusal"):
    refusal: str


_ChatPart = _Text | _ImageUrl | _InputAudioPart | _AudioUrl | _VideoUrl | _Refusal


class _ChatMessage(msgspec.Struct, frozen=True, gc=False):
    role: str
    content: str | list[_ChatPart] | None = None
    name: str | None = None
    tool_calls: list[msgspec.Raw] | None = None
    tool_call_id: str | None = None


class ChatRequest(msgspec.Struct, frozen=True, gc=False):
    model: str
    messages: list[_ChatMessage]
    tools: list[msgspec.Raw] | None = None
    stream: bool | None = None
    cache_salt: str | None = None
    # The output cap (vLLM: max_completion_tokens wins over the older max_tokens).
    max_tokens: int | float | None = None
    max_completion_tokens: int | float | None = None
    # vLLM's tokenization options: they change the token ids, so precise keys follow them.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    # vLLM's engine priority (lower first): only whether the client set one (flow control's
    # `engine_priority` replaces it; docs/flow-control.md).
    priority: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


class CompletionsRequest(msgspec.Struct, frozen=True, gc=False):
    model: str
    prompt: msgspec.Raw
    stream: bool | None = None
    cache_salt: str | None = None
    max_tokens: int | float | None = None
    add_special_tokens: bool | None = None
    # vLLM's engine priority (lower first): only whether the client set one (flow control's
    # `engine_priority` replaces it; docs/flow-control.md).
    priority: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


class EmbeddingsRequest(msgspec.Struct, frozen=True, gc=False):
    model: str
    input: msgspec.Raw
    cache_salt: str | None = None
    stream: bool | None = None
    # vLLM's engine priority (lower first): only whether the client set one (flow control's
    # `engine_priority` replaces it; docs/flow-control.md).
    priority: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


class _InputText(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="input_text"):
    text: str


class _OutputText(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="output_text"):
    text: str


class _ReasoningText(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="reasoning_text"):
    text: str


class _InputImage(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="input_image"):
    image_url: str | None = None
    file_id: str | None = None


class _ResponsesAudio(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="input_audio"):
    input_audio: _InputAudio


_ResponsesPart = (
    _InputText | _OutputText | _ReasoningText | _Refusal | _InputImage | _ResponsesAudio
)


class _ResponsesItem(msgspec.Struct, frozen=True, gc=False):
    type: str = "message"
    role: str | None = None
    content: str | list[_ResponsesPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[_ResponsesPart] | None = None


class ResponsesRequest(msgspec.Struct, frozen=True, gc=False):
    model: str
    input: str | list[_ResponsesItem] | None = None
    instructions: str | None = None
    tools: list[msgspec.Raw] | None = None
    stream: bool | None = None
    cache_salt: str | None = None
    max_output_tokens: int | float | None = None
    # vLLM's engine priority (lower first): only whether the client set one (flow control's
    # `engine_priority` replaces it; docs/flow-control.md).
    priority: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


_PROMPT_TEXTS = msgspec.json.Decoder(str | list[str])
_PROMPT_IDS = msgspec.json.Decoder(list[TokenId])
_PROMPT_ID_LISTS = msgspec.json.Decoder(list[list[TokenId]])

PromptInput = str | tuple[int, ...]


def prompt_inputs(raw: msgspec.Raw, field: str) -> list[PromptInput]:
    """A completions `prompt` / embeddings `input`: a string, a list of strings, a list of
    token ids, or a list of token-id lists. Each shape is tried with a C decoder, so a
    100k-id prompt costs no Python loop."""
    try:
        texts = _PROMPT_TEXTS.decode(raw)
        return [texts] if isinstance(texts, str) else list(texts)
    except msgspec.ValidationError:
        pass
    except msgspec.DecodeError:
        # The body's decoder checks a Raw field's JSON shape, not its strings' UTF-8.
        raise not_utf8(field) from None
    try:
        return [tuple(_PROMPT_IDS.decode(raw))]
    except msgspec.ValidationError:
        pass
    try:
        return [tuple(ids) for ids in _PROMPT_ID_LISTS.decode(raw)]
    except msgspec.ValidationError:
        raise BadRequest(
            f"{field}: must be a string, a list of strings, a list of token ids"
            " or a list of token-id lists"
        ) from None


def _url(value: str | _Url, field: str) -> tuple[str, str]:
    """The URL of a `str | {url}` reference, and the field path naming it."""
    return (value, field) if isinstance(value, str) else (value.url, f"{field}.url")


def chat_prompt(req: ChatRequest, media: MediaResolver) -> Prompt:
    messages = []
    for i, m in enumerate(req.messages):
        parts: tuple[Part, ...] = ()
        if isinstance(m.content, str):
            parts = (Part(m.content),)
        elif m.content is not None:
            parts = tuple(
                _chat_part(p, media, f"messages[{i}].content[{j}]") for j, p in enumerate(m.content)
            )
        calls = raw_jsons(m.tool_calls, f"messages[{i}].tool_calls")
        messages.append(Message(m.role, parts, m.name, calls, m.tool_call_id))
    return Prompt(
        tools=raw_jsons(req.tools, "tools"),
        messages=tuple(messages),
        add_special_tokens=req.add_special_tokens,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=bool(req.continue_final_message),
    )


def _chat_part(p: _ChatPart, media: MediaResolver, field: str) -> Part:
    if isinstance(p, _Text):
        return Part(p.text)
    if isinstance(p, _ImageUrl):
        return Part(media=media.image_url(*_url(p.image_url, f"{field}.image_url")))
    if isinstance(p, _InputAudioPart):
        where = f"{field}.input_audio.data"
        return Part(media=media.audio_bytes(decode_base64(p.input_audio.data, where), where))
    if isinstance(p, _AudioUrl):
        return Part(media=media.audio_url(*_url(p.audio_url, f"{field}.audio_url")))
    if isinstance(p, _VideoUrl):
        return Part(media=media.video_url(*_url(p.video_url, f"{field}.video_url")))
    return Part(p.refusal)


def responses_prompt(req: ResponsesRequest, media: MediaResolver) -> Prompt:
    messages: list[Message] = []
    if req.instructions is not None:
        messages.append(Message("system", (Part(req.instructions),)))
    if isinstance(req.input, str):
        messages.append(Message("user", (Part(req.input),)))
    elif req.input is not None:
        for i, item in enumerate(req.input):
            messages.append(_responses_item(item, media, f"input[{i}]"))
    return Prompt(tools=raw_jsons(req.tools, "tools"), messages=tuple(messages))


def _responses_item(item: _ResponsesItem, media: MediaResolver, field: str) -> Message:
    if item.type in ("message", "reasoning"):
        role = item.role or ("assistant" if item.type == "reasoning" else "user")
        return Message(role, _responses_parts(item.content, media, f"{field}.content"))
    if item.type == "function_call":
        call = msgspec.json.encode(
            {"call_id": item.call_id, "name": item.name, "arguments": item.arguments}
        )
        return Message("assistant", tool_calls=(call,))
    if item.type == "function_call_output":
        parts = _responses_parts(item.output, media, f"{field}.output")
        return Message("tool", parts, tool_call_id=item.call_id)
    raise BadRequest(f"{field}.type: unsupported input item type")


def _responses_parts(
    content: str | list[_ResponsesPart] | None, media: MediaResolver, field: str
) -> tuple[Part, ...]:
    if content is None:
        return ()
    if isinstance(content, str):
        return (Part(content),)
    parts = []
    for j, p in enumerate(content):
        where = f"{field}[{j}]"
        if isinstance(p, _InputText | _OutputText | _ReasoningText):
            parts.append(Part(p.text))
        elif isinstance(p, _Refusal):
            parts.append(Part(p.refusal))
        elif isinstance(p, _InputImage):
            if p.image_url is not None:
                parts.append(Part(media=media.image_url(p.image_url, f"{where}.image_url")))
            elif p.file_id is not None:
                parts.append(Part(media=media.remote_image(f"file:{p.file_id}")))
            else:
                raise BadRequest(f"{where}: needs image_url or file_id")
        else:
            data = decode_base64(p.input_audio.data, f"{where}.input_audio.data")
            parts.append(Part(media=media.audio_bytes(data, f"{where}.input_audio.data")))
    return tuple(parts)
