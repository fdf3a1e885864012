"""Engine-side priority (`flow_control.engine_priority`): the request's priority band sent to
the model server as vLLM's priority, in the body as `priority` (`body`, or `true`) or as the
`x-vllm-priority` header (`header`); served by an engine started with `--scheduling-policy
priority`: lower value first, ties by arrival; default 0.

Why: flow control orders requests in the picker, but once released a request joins the
engine's own queue, where an interactive request waited behind batch prefills (FCFS). With
the band sent along the engine serves the higher band's prefills first too.

The mapping is `-band` (band 10 -> -10, band 0 -> 0, band -1 -> 1): a higher band gets a
smaller number, bands keep their order, and the default band keeps vLLM's default.

The body form. The client does not choose its place in the engine's queue: a `priority` it
sent is replaced, and the `x-vllm-priority` header (which vLLM 0.32 reads before the body) is
removed. Without a client `priority` (the common case) the field is inserted right after
the body's opening brace: a few bytes ahead of the untouched body (`BodyEdit`), no second
copy of a large body on the streamed path. With one, the body is re-encoded with the value
replaced (the client asked for a priority; it pays for the copy).

The header form (`via="header"`, `engine_priority: header`) sends the band as the
`x-vllm-priority` request header instead, replacing any the client sent, and leaves the
body alone: no body mutation
at all (the streamed chunks go back as they came; BUFFERED sends no body mutation), and it
reaches engines whose body the picker never sees (body modes NONE / STREAMED, a body cut at
the proxy's buffer limit). vLLM 0.32 reads the header before the body's `priority`
(`_get_priority` in its serving code), so a client's body `priority` is overridden by the
engine itself and needs no rewrite; a non-integer one is refused by the engine as it would
be without the picker (the client's own malformed request). Only the APIs whose vLLM
handler reads the header get it (`HEADER_APIS`: Anthropic messages too, which the body form
cannot reach); embeddings, where vLLM reads only the body, get the body edit instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

import msgspec
from prometheus_client import CollectorRegistry, Counter

from extproc.core import Api
from extproc.protocol import ENGINE_PRIORITY_HEADER

__all__ = [
    "ENGINE_PRIORITY_HEADER",
    "EngineEdit",
    "EnginePriority",
    "Via",
    "engine_priority",
    "with_priority",
]

# The APIs whose vLLM request carries `priority` (vLLM 0.32: chat, completions, responses,
# embeddings; its Anthropic messages request has none).
APIS = frozenset({Api.CHAT, Api.COMPLETIONS, Api.RESPONSES, Api.EMBEDDINGS})
# The APIs whose vLLM handler reads `x-vllm-priority` (vLLM 0.32: `_get_priority` in
# entrypoints/generate/base/serving.py, called by chat, completions and responses; Anthropic
# messages are served as a chat completion with the same raw request, so the header counts
# there too; pooling (embeddings) reads only the body's `priority`).
HEADER_APIS = frozenset({Api.CHAT, Api.COMPLETIONS, Api.RESPONSES, Api.MESSAGES})

# Where the band goes: `body` (vLLM's `priority` field) or `header` (`x-vllm-priority`).
Via = Literal["body", "header"]

OUTCOMES = ("inserted", "replaced", "header", "skipped")

_WS = b" \t\r\n"


def engine_priority(band: int) -> int:
    """The engine's priority for a flow-control band: higher band, smaller number."""
    return -band


@dataclass(frozen=True, slots=True)
class BodyEdit:
    """The body the engine gets: `head` followed by `body[rest_from:]` (only `head` is new)."""

    head: bytes
    rest_from: int

    def length(self, body_len: int) -> int:
        return len(self.head) + body_len - self.rest_from

    def join(self, body: bytes) -> bytes:
        return self.head + body[self.rest_from :] if self.rest_from < len(body) else self.head


def with_priority(body: bytes, value: int, *, client_set: bool) -> BodyEdit:
    """`body` (a JSON object, as the request parser accepted it) with top-level `priority`
    set to `value`. `client_set`: the body already has one (the parser saw it)."""
    if client_set:
        return _replaced(body, value)
    i = 0
    n = len(body)
    while i < n and body[i] in _WS:
        i += 1
    if i == n or body[i] != 0x7B:  # "{": anything else was refused by the parser
        return _replaced(body, value)
    j = i + 1
    while j < n and body[j] in _WS:
        j += 1
    field_ = b'"priority":%d' % value
    if j < n and body[j] == 0x7D:  # "{}": no member to separate from
        return BodyEdit(body[: i + 1] + field_, i + 1)
    return BodyEdit(body[: i + 1] + field_ + b",", i + 1)


def _replaced(body: bytes, value: int) -> BodyEdit:
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError:
        doc = json.loads(body)  # what msgspec refuses and the parser let through
    if not isinstance(doc, dict):
        raise ValueError("body is not a JSON object")
    doc["priority"] = value
    return BodyEdit(msgspec.json.encode(doc), len(body))


@dataclass(frozen=True, slots=True)
class EngineEdit:
    """What one decision does to the forwarded request for engine priority: headers set
    (replacing the client's), headers removed, and the body edit (None: untouched)."""

    set_headers: tuple[tuple[str, str], ...] = ()
    remove_headers: tuple[str, ...] = ()
    body: BodyEdit | None = None


# The client's header never reaches the engine, whatever else happens to the request.
_REMOVED = EngineEdit(remove_headers=(ENGINE_PRIORITY_HEADER,))


@dataclass(slots=True)
class EnginePriority:
    """The switch, where the band goes (`via`: `body` or `header`), and the counter
    (`extproc_flow_engine_priority_total{outcome}`): `inserted` (into a body without a
    client priority), `replaced` (the client's, in the body), `header` (sent as
    `x-vllm-priority`), `skipped` (the feature is on but this request's engine priority was
    not set: an API without it, no body to write into, or no flow-control band)."""

    registry: CollectorRegistry | None = None
    via: Via = "body"
    _counter: Counter | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._counter = Counter(
            "extproc_flow_engine_priority",
            "Requests whose engine priority the picker set (flow_control.engine_priority), "
            "by outcome: inserted / replaced (the client's own) in the forwarded body, "
            "header (x-vllm-priority), skipped (not set: API without it, no body seen, or "
            "no band).",
            ["outcome"],
            registry=self.registry,
        )
        for o in OUTCOMES:
            self._counter.labels(o)

    def count(self, outcome: str) -> None:
        assert self._counter is not None
        self._counter.labels(outcome).inc()

    def plan(
        self, api: Api, band: int | None, body: bytes | None, *, client_set: bool
    ) -> EngineEdit:
        """The edit for one decision. `band`: flow control's (None: the request has none);
        `body`: the whole body (None or empty: not seen). Counted once per call."""
        if band is None:
            self.count("skipped")
            return _REMOVED
        if self.via == "header" and api in HEADER_APIS:
            self.count("header")
            return EngineEdit(set_headers=((ENGINE_PRIORITY_HEADER, str(engine_priority(band))),))
        # The body form, and the header form's fallback where the engine reads only the body
        # (embeddings): the band reaches the engine however it reads it.
        edit = self.edit(api, band, body or b"", client_set=client_set)
        return (
            _REMOVED
            if edit is None
            else EngineEdit(remove_headers=_REMOVED.remove_headers, body=edit)
        )

    def edit(self, api: Api, band: int, body: bytes, *, client_set: bool) -> BodyEdit | None:
        """The body edit for one request (None: the body goes as it came, counted
        `skipped`)."""
        if api not in APIS or not body:
            self.count("skipped")
            return None
        out = with_priority(body, engine_priority(band), client_set=client_set)
        self.count("replaced" if client_set else "inserted")
        return out
