"""The protobuf door: ext_proc messages in, ext_proc messages out. Nothing past this module
sees a protobuf object; nothing here makes a routing decision.

Messages are our wire-compatible subset of Envoy's API (see protos/), upb-backed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import orjson

from extproc import protocol
from extproc._proto.extproc.wire.v1 import ext_proc_pb2 as pb
from extproc.core import Decision
from extproc.errors import ExtprocError

ProcessingRequest = pb.ProcessingRequest
ProcessingResponse = pb.ProcessingResponse
BodySendMode = pb.ProcessingMode.BodySendMode

_OVERWRITE = pb.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_map(hmap: pb.HeaderMap) -> dict[str, str]:
    """Envoy's header map -> {lower-case name: value}. Envoy sends values in `raw_value`;
    a repeated header keeps its first value, as the picker only reads single-valued ones."""
    out: dict[str, str] = {}
    for hv in hmap.headers:
        key = hv.key  # each field read builds a new str from upb: read it once
        if key not in out:
            raw = hv.raw_value
            out[key] = raw.decode("utf-8", "replace") if raw else hv.value
    return out


def header_value(hmap: pb.HeaderMap, name: str) -> str | None:
    """One header's first value (lower-case `name`), without building the whole map."""
    for hv in hmap.headers:
        if hv.key == name:
            raw = hv.raw_value
            return raw.decode("utf-8", "replace") if raw else hv.value
    return None


def subset_hint(req: pb.ProcessingRequest) -> frozenset[str] | None:
    """The proxy's subset hint, or None when it sent none (an empty list is a real, empty
    subset: nothing is eligible)."""
    if not req.HasField("metadata_context"):
        return None
    ns = req.metadata_context.filter_metadata.get(protocol.SUBSET_HINT_NAMESPACE)
    if ns is None or protocol.SUBSET_HINT_KEY not in ns.fields:
        return None
    value = ns.fields[protocol.SUBSET_HINT_KEY]
    kind = value.WhichOneof("kind")
    # A list entry may itself be a comma list (header-to-metadata filters write one string).
    if kind == "list_value":
        raw = ",".join(v.string_value for v in value.list_value.values)
    elif kind == "string_value":
        raw = value.string_value
    else:
        return frozenset()
    # "[::1]:8000" and "10.0.0.1" alike: brackets dropped from a port-less IPv6 entry.
    out = set()
    for entry in raw.split(","):
        entry = entry.strip()
        if entry:
            out.add(entry.strip("[]") if entry.startswith("[") and entry.endswith("]") else entry)
    return frozenset(out)


def served_endpoint(req: pb.ProcessingRequest) -> str | None:
    """The endpoint that really served, as the proxy reports it on the response path
    (`envoy.lb` / `x-gateway-destination-endpoint-served`, forwarded by ext_proc's
    `forwarding_namespaces`; Envoy's override_host writes it with `selected_host_key`)."""
    if not req.HasField("metadata_context"):
        return None
    ns = req.metadata_context.filter_metadata.get(protocol.LB_NAMESPACE)
    if ns is None or protocol.SERVED_KEY not in ns.fields:
        return None
    served = ns.fields[protocol.SERVED_KEY].string_value.strip()
    return served or None


def _set_header(mutation: pb.HeaderMutation, name: str, value: str) -> None:
    opt = mutation.set_headers.add()
    opt.header.key = name
    opt.header.raw_value = value.encode()
    opt.append_action = _OVERWRITE


def _routing(common: pb.CommonResponse, resp: pb.ProcessingResponse, decision: Decision) -> None:
    destination = ",".join(e.address for e in decision.endpoints)
    _set_header(common.header_mutation, protocol.DESTINATION_HEADER, destination)
    for name, value in decision.headers.items():
        _set_header(common.header_mutation, name, value)
    common.clear_route_cache = True
    resp.dynamic_metadata.update({protocol.LB_NAMESPACE: {protocol.DESTINATION_KEY: destination}})


def routed_headers(decision: Decision) -> pb.ProcessingResponse:
    """Header response carrying the decision (FULL_DUPLEX_STREAMED and body-less requests)."""
    resp = pb.ProcessingResponse()
    _routing(resp.request_headers.response, resp, decision)
    return resp


def routed_body(decision: Decision) -> pb.ProcessingResponse:
    """Body response carrying the decision (BUFFERED: header mutations ride on it)."""
    resp = pb.ProcessingResponse()
    _routing(resp.request_body.response, resp, decision)
    return resp


class DecisionReplies:
    """Decision replies built once per destination and reused by every stream: a reply
    depends only on the endpoint list and the extra headers, and gRPC's serializer only reads
    it (building one costs ~12 us of protobuf calls, header and `envoy.lb` Struct). Bounded:
    emptied when it holds `limit` replies (per-request headers make keys that never repeat)."""

    __slots__ = ("_cache", "_limit")

    def __init__(self, limit: int = 4096) -> None:
        self._cache: dict[tuple, pb.ProcessingResponse] = {}
        self._limit = limit

    def headers(self, decision: Decision) -> pb.ProcessingResponse:
        return self._get(decision, routed_headers)

    def body(self, decision: Decision) -> pb.ProcessingResponse:
        return self._get(decision, routed_body)

    def _get(self, decision: Decision, build) -> pb.ProcessingResponse:
        extra = tuple(decision.headers.items()) if decision.headers else ()
        key = (build, tuple(e.address for e in decision.endpoints), extra)
        resp = self._cache.get(key)
        if resp is None:
            if len(self._cache) >= self._limit:
                self._cache.clear()
            resp = self._cache[key] = build(decision)
        return resp


def _only(phase: str) -> pb.ProcessingResponse:
    """A reply that lets `phase` continue unchanged."""
    resp = pb.ProcessingResponse()
    getattr(resp, phase).SetInParent()
    return resp


# Built once: these replies never vary, and the serializer only reads them.
CONTINUE_REQUEST_HEADERS = _only("request_headers")
CONTINUE_REQUEST_BODY = _only("request_body")
CONTINUE_REQUEST_TRAILERS = _only("request_trailers")
CONTINUE_RESPONSE_HEADERS = _only("response_headers")
CONTINUE_RESPONSE_BODY = _only("response_body")
CONTINUE_RESPONSE_TRAILERS = _only("response_trailers")


def echo_response_body(body: pb.HttpBody) -> pb.ProcessingResponse:
    """FULL_DUPLEX_STREAMED response chunk handed back unchanged, `end_of_stream` kept. The
    bytes object is shared with the incoming message: nothing parsed, nothing copied here."""
    resp = pb.ProcessingResponse()
    sr = resp.response_body.response.body_mutation.streamed_response
    sr.body = body.body
    sr.end_of_stream = body.end_of_stream
    return resp


def cheapest_response_mode(request_body_mode: int) -> pb.ProcessingMode:
    """A `mode_override` asking Envoy to stop sending response bodies and trailers (the picker
    only needs the response headers). Body modes are always taken from an override, so the
    request's own is repeated; DEFAULT header/trailer modes leave Envoy's setting alone.
    Envoy applies it only with `allow_mode_override` and neither body mode FULL_DUPLEX."""
    mode = pb.ProcessingMode()
    mode.request_body_mode = request_body_mode  # type: ignore[assignment]
    mode.response_body_mode = BodySendMode.NONE
    mode.response_trailer_mode = pb.ProcessingMode.SKIP
    return mode


def response_headers_with(headers: Mapping[str, str]) -> pb.ProcessingResponse:
    """Response headers pass through with `headers` added (overwriting same-named ones)."""
    resp = pb.ProcessingResponse()
    mutation = resp.response_headers.response.header_mutation
    for name, value in headers.items():
        _set_header(mutation, name, value)
    return resp


def streamed_body(
    body: bytes, *, end_of_stream: bool, head: bytes = b"", rest_from: int = 0
) -> Iterator[pb.ProcessingResponse]:
    """The body echoed back in chunks of at most BODY_CHUNK_BYTES: `head` followed by
    `body[rest_from:]` (an edit that leaves the rest of the body as it came, no copy of it
    beyond the chunk slices). FULL_DUPLEX_STREAMED needs at least one chunk, even for an
    empty body, to carry `end_of_stream`."""
    size = protocol.BODY_CHUNK_BYTES
    h = len(head)
    total = h + len(body) - rest_from
    last = max(0, (total - 1) // size)
    for i in range(last + 1):
        a, b = i * size, (i + 1) * size
        if not h:
            part = body[rest_from + a : rest_from + b]
        elif b <= h:
            part = head[a:b]
        elif a >= h:
            part = body[rest_from + a - h : rest_from + b - h]
        else:
            part = head[a:] + body[rest_from : rest_from + b - h]
        resp = pb.ProcessingResponse()
        sr = resp.request_body.response.body_mutation.streamed_response
        sr.body = part
        sr.end_of_stream = end_of_stream and i == last
        yield resp


def with_request_edit(
    resp: pb.ProcessingResponse,
    *,
    set_headers: Mapping[str, str],
    remove_headers: tuple[str, ...] = (),
    body: bytes | None = None,
) -> pb.ProcessingResponse:
    """A copy of a request-phase decision reply (headers or BUFFERED body; the cached one
    stays untouched) that also sets `set_headers`, removes `remove_headers` and, with
    `body`, replaces the buffered body."""
    out = pb.ProcessingResponse()
    out.CopyFrom(resp)
    common = (
        out.request_headers.response
        if out.WhichOneof("response") == "request_headers"
        else out.request_body.response
    )
    for name, value in set_headers.items():
        _set_header(common.header_mutation, name, value)
    common.header_mutation.remove_headers.extend(remove_headers)
    if body is not None:
        common.body_mutation.body = body
    return out


def error_response(
    err: ExtprocError, extra_headers: Mapping[str, str] | None = None
) -> pb.ProcessingResponse:
    """An ImmediateResponse with an OpenAI-style JSON error body."""
    resp = pb.ProcessingResponse()
    ir = resp.immediate_response
    ir.status.code = err.status
    ir.body = orjson.dumps(
        {"error": {"message": err.message, "type": err.type, "code": err.code, "param": None}}
    )
    ir.details = err.code
    _set_header(ir.headers, "content-type", "application/json")
    for name, value in (extra_headers or {}).items():
        _set_header(ir.headers, name, value)
    return resp
