"""JSON the body's decoder keeps raw (tools, tool calls, a tool use's input, the client's
`priority`): its bytes are hashed or forwarded as they came, so the decoder checks their JSON
shape but never their strings' UTF-8. Checked here, when the request is parsed, so a body no
engine would accept is a 400 at the picker, and nothing after the parser (engine priority's
body edit decodes the whole body) meets undecodable text."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from extproc.errors import BadRequest


def not_utf8(field: str) -> BadRequest:
    """The 400 for a kept-raw JSON field whose strings are not UTF-8 (here and wherever else
    such a field is decoded, e.g. a completions `prompt`)."""
    return BadRequest(f"{field}: must be valid UTF-8 JSON")


def raw_json(raw: msgspec.Raw, field: str) -> bytes:
    """The bytes of `raw`, refused unless they are UTF-8 (ASCII, the usual case, costs one
    scan without decoding)."""
    data = bytes(raw)
    if not data.isascii():
        try:
            data.decode()
        except UnicodeDecodeError:
            raise not_utf8(field) from None
    return data


def raw_jsons(raws: Sequence[msgspec.Raw] | None, field: str) -> tuple[bytes, ...]:
    """`raw_json` of each item of a list field (empty when it is absent)."""
    return tuple(raw_json(r, f"{field}[{i}]") for i, r in enumerate(raws)) if raws else ()
