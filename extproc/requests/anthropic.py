"""Anthropic Messages bodies (`/v1/messages`) -> `Prompt`, mapped onto chat roles: `system`
becomes a system turn, `tool_use` blocks assistant tool calls, `tool_result` blocks tool
turns (the shape engines convert Anthropic requests into before templating).
"""

from __future__ import annotations

import msgspec

from extproc.core import MediaItem, Message, Part, Prompt
from extproc.requests.media import MediaResolver, decode_base64
from extproc.requests.raw import raw_json, raw_jsons


class _Base64Source(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="base64"):
    data: str
    media_type: str = ""


class _UrlSource(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="url"):
    url: str


class _Text(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="text"):
    text: str


class _Image(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="image"):
    source: _Base64Source | _UrlSource


class _ToolUse(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: msgspec.Raw


class _ToolResult(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="tool_result"):
    tool_use_id: str
    content: str | list[_Text | _Image] | None = None


class _Thinking(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="thinking"):
    thinking: str


class _RedactedThinking(
    msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="redacted_thinking"
):
    data: str


_Block = _Text | _Image | _ToolUse | _ToolResult | _Thinking | _RedactedThinking


class _Message(msgspec.Struct, frozen=True, gc=False):
    role: str
    content: str | list[_Block]


class MessagesRequest(msgspec.Struct, frozen=True, gc=False):
    model: str
    messages: list[_Message]
    system: str | list[_Text] | None = None
    tools: list[msgspec.Raw] | None = None
    stream: bool | None = None
    max_tokens: int | float | None = None  # required by Anthropic's API, optional here


def messages_prompt(req: MessagesRequest, media: MediaResolver) -> Prompt:
    turns: list[Message] = []
    if isinstance(req.system, str):
        turns.append(Message("system", (Part(req.system),)))
    elif req.system:
        turns.append(Message("system", tuple(Part(b.text) for b in req.system)))
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            turns.append(Message(m.role, (Part(m.content),)))
            continue
        parts: list[Part] = []
        calls: list[bytes] = []
        results: list[Message] = []
        for j, block in enumerate(m.content):
            field = f"messages[{i}].content[{j}]"
            if isinstance(block, _Text):
                parts.append(Part(block.text))
            elif isinstance(block, _Image):
                parts.append(Part(media=_image(block, media, f"{field}.source")))
            elif isinstance(block, _Thinking):
                parts.append(Part(block.thinking))
            elif isinstance(block, _RedactedThinking):
                parts.append(Part(block.data))
            elif isinstance(block, _ToolUse):
                raw_json(block.input, f"{field}.input")  # refused unless UTF-8
                calls.append(
                    msgspec.json.encode({"id": block.id, "name": block.name, "input": block.input})
                )
            else:
                results.append(_tool_result(block, media, f"{field}.content"))
        # Engines put tool results before the text that follows them in the same turn.
        turns.extend(results)
        if parts or calls or not results:
            turns.append(Message(m.role, tuple(parts), tool_calls=tuple(calls)))
    return Prompt(tools=raw_jsons(req.tools, "tools"), messages=tuple(turns))


def _image(block: _Image, media: MediaResolver, field: str) -> MediaItem:
    src = block.source
    if isinstance(src, _UrlSource):
        return media.image_url(src.url, f"{field}.url")
    return media.image_bytes(decode_base64(src.data, f"{field}.data"), f"{field}.data")


def _tool_result(block: _ToolResult, media: MediaResolver, field: str) -> Message:
    if block.content is None:
        parts: tuple[Part, ...] = ()
    elif isinstance(block.content, str):
        parts = (Part(block.content),)
    else:
        parts = tuple(
            Part(b.text)
            if isinstance(b, _Text)
            else Part(media=_image(b, media, f"{field}[{k}].source"))
            for k, b in enumerate(block.content)
        )
    return Message("tool", parts, tool_call_id=block.tool_use_id)
