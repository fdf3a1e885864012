"""Approximate prefix block keys: a canonical byte stream per prompt, cut into blocks and
chained with xxh3, so that requests sharing a conversation prefix share leading keys.

No tokenizer involved: text counts by its UTF-8 bytes, a media item by a run of placeholder
units as long as its estimated token cost. `docs/requests.md` specifies the stream.
"""

from __future__ import annotations

import struct

import xxhash

from extproc.core import Message, Prompt

# 0xFE and 0xFF never occur in UTF-8, so no text (or raw JSON) can forge a marker.
_TOOL = b"\xff\x01"
_ROLE = b"\xff\x02"
_NAME = b"\xff\x03"
_CALL_ID = b"\xff\x04"
_MEDIA = b"\xff\x05"
_CALL = b"\xff\x06"
_IDS = b"\xff\x07"
_END = b"\xfe"
_PART_SEP = b"\n"  # vLLM joins text parts with a newline for string-content templates
_SEED_DOMAIN = b"extproc/approx/v1\0"

_xxh3 = xxhash.xxh3_64_intdigest


def approx_seed(model: str, lora_adapter: str | None = None, cache_salt: str | None = None) -> int:
    """The parent key of block 0: separates models, adapters and cache-salt tenants."""
    parts = [_SEED_DOMAIN, model.encode("utf-8", "surrogatepass"), b"\0"]
    if lora_adapter:
        parts += [b"a", lora_adapter.encode("utf-8", "surrogatepass"), b"\0"]
    if cache_salt:
        parts += [b"s", cache_salt.encode("utf-8", "surrogatepass"), b"\0"]
    return _xxh3(b"".join(parts))


def placeholder(digest: bytes, tokens: int, bytes_per_token: int) -> bytes:
    """`tokens` units of `bytes_per_token` bytes, filled by repeating the asset's digest."""
    size = tokens * bytes_per_token
    return (digest * (size // len(digest) + 1))[:size]


def canonical_stream(prompt: Prompt, bytes_per_token: int, limit_bytes: int) -> bytes:
    """The first `limit_bytes` bytes of the prompt's canonical byte stream."""
    pieces: list[bytes] = []
    size = 0
    for tool in prompt.tools:
        if size >= limit_bytes:
            break
        pieces += (_TOOL, tool)
        size += 2 + len(tool)
    if prompt.completion is not None:
        c = prompt.completion
        if isinstance(c, str):
            pieces.append(_encode_head(c, limit_bytes))
        else:
            pieces.append(_IDS)
            # Token ids weigh 4 bytes each, the same as a text token at the default width.
            n = min(len(c), limit_bytes // 4 + 1)
            pieces.append(struct.pack(f"<{n}I", *c[:n]))
    for message in prompt.messages:
        size = _add_message(pieces, size, limit_bytes, message, bytes_per_token)
        if size >= limit_bytes:
            break
    stream = b"".join(pieces)
    return stream if len(stream) <= limit_bytes else stream[:limit_bytes]


def _encode_head(text: str, room_bytes: int) -> bytes:
    """UTF-8 of enough of `text` to fill `room_bytes` (a character is at least one byte), so
    a 4 MB message past the cap is never encoded whole."""
    if len(text) > room_bytes:
        text = text[: max(room_bytes, 0)]
    return text.encode("utf-8", "surrogatepass")


def _add_message(pieces: list[bytes], size: int, limit: int, m: Message, bpt: int) -> int:
    """Appends `m`'s pieces; returns the stream's size after them. Called per turn of a
    long conversation, so the pieces go straight onto the list (no call per piece); a
    piece that starts past `limit` is left out, as no block past the cap is hashed."""
    role = m.role.encode("utf-8", "surrogatepass")
    pieces += (_ROLE, role, _END)
    size += 3 + len(role)
    if m.name is not None:
        name = m.name.encode("utf-8", "surrogatepass")
        pieces += (_NAME, name, _END)
        size += 3 + len(name)
    if m.tool_call_id is not None:
        call_id = m.tool_call_id.encode("utf-8", "surrogatepass")
        pieces += (_CALL_ID, call_id, _END)
        size += 3 + len(call_id)
    previous_text = False
    for part in m.parts:
        if size >= limit:
            return size
        if part.media is None:
            if previous_text:
                pieces.append(_PART_SEP)
                size += 1
                if size >= limit:
                    return size
            text = _encode_head(part.text, limit - size)
            pieces.append(text)
            size += len(text)
            previous_text = True
        else:
            digest = bytes.fromhex(part.media.content_hash)
            # Clip to the room left: a 16k-token video must not build 64 KB past the cap.
            room = (limit - size) // bpt + 1
            pieces.append(_MEDIA)
            size += 2
            if size >= limit:
                return size
            unit = placeholder(digest, min(part.media.tokens, room), bpt)
            pieces.append(unit)
            size += len(unit)
            previous_text = False
    for call in m.tool_calls:
        if size >= limit:
            return size
        pieces += (_CALL, call)
        size += 2 + len(call)
    return size


def block_keys(stream: bytes, block_bytes: int, seed: int) -> tuple[int, ...]:
    """Chained keys of the full blocks of `stream`: key_i = xxh3_64(block_i, seed=key_{i-1}),
    key_{-1} = `seed`. A trailing partial block gets no key (engines cache full blocks only).

    Seeding with the parent key chains in one C call per block (~0.15 µs), with no
    concatenation; any change in block j changes every key from j on.
    """
    if block_bytes <= 0:
        raise ValueError("block_bytes must be positive")
    view = memoryview(stream)
    keys: list[int] = []
    append = keys.append
    parent = seed
    for start in range(0, len(stream) - block_bytes + 1, block_bytes):
        parent = _xxh3(view[start : start + block_bytes], parent)
        append(parent)
    return tuple(keys)
