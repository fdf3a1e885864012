"""One ext_proc stream = one HTTP request. The state machine that reads headers and body,
asks the router for a decision at the right moment, and answers in the order Envoy expects.

FULL_DUPLEX_STREAMED (what gateways use): hold the header reply until the body has ended
(last body chunk, or trailers), then send: header response with the decision, the body echoed
in <= 62,000-byte chunks (last one end_of_stream unless trailers follow), trailers response.
BUFFERED: Envoy waits for each reply; headers get CONTINUE, the single body message gets the
decision (header mutations are honoured on a body response in this mode).
BUFFERED_PARTIAL: the body message is answered with the decision even when Envoy cut it at
its buffer limit (end_of_stream false); a cut body is not parsed, the request is routed on
headers. Body-less requests, and modes that never send a body (NONE, STREAMED), are decided at
header time; such decisions are counted in `extproc_decisions_without_body` and logged once.

Response path, whatever mode the gateway announces in `protocol_config`: headers pass through,
plus what the decision sends back to the client (a session token; the explanation when asked
for with `x-extproc-explain: 1`); FULL_DUPLEX_STREAMED body chunks are echoed unchanged and in
order (Envoy drops its copy and waits for ours); other body modes get CONTINUE; trailers get
their reply. Where neither body mode is FULL_DUPLEX_STREAMED, the request-header reply carries
a `mode_override` asking for no response body or trailers (honoured when the gateway sets
`allow_mode_override`, ignored otherwise). The served endpoint the proxy reports on the
response headers (`envoy.lb` metadata) takes over the in-flight count and the index entry.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import orjson

from extproc import protocol
from extproc.core import Decision
from extproc.errors import ExtprocError, PayloadTooLarge
from extproc.router import Routed, Router
from extproc.server import wire
from extproc.server.metrics import PickerMetrics

log = logging.getLogger("extproc.stream")

_FULL_DUPLEX = wire.BodySendMode.FULL_DUPLEX_STREAMED
_BUFFERED = (wire.BodySendMode.BUFFERED, wire.BodySendMode.BUFFERED_PARTIAL)
_PARTIAL = wire.BodySendMode.BUFFERED_PARTIAL
_NO_BODY = wire.BodySendMode.NONE


def explanation(routed: Routed) -> dict:
    """A decision as JSON-ready data: what was chosen, every plugin's scores, what filters
    removed, and the prefix matches the index reported."""
    d = routed.decision
    return {
        "request_id": routed.request.request_id,
        "profile": d.profile,
        "endpoints": [e.address for e in d.endpoints],
        "prefill": d.prefill.address if d.prefill else None,
        "encoders": [e.address for e in d.encoders],
        "headers": dict(d.headers),
        "scores": {k: dict(v) for k, v in d.scores.items()},
        "reasons": list(d.reasons),
        "prefix_blocks": dict(routed.lookup.matches),
        "request_blocks": len(routed.request.block_keys),
        "index_degraded": routed.lookup.degraded,
        "prompt_tokens": routed.request.prompt_tokens,
        "predicted_cached_tokens": predicted_cached_tokens(routed),
    }


def predicted_cached_tokens(routed: Routed) -> int:
    """Prompt tokens the chosen endpoint is expected to serve from its cache: its matched
    leading blocks times tokens per block. In precise mode the keys stop before the
    prompt's last token (the engine never serves it from cache), so this is comparable to
    the engine's `usage.prompt_tokens_details.cached_tokens`."""
    if not routed.decision.endpoints:
        return 0
    matched = routed.lookup.matches.get(routed.decision.primary.address, 0.0)
    return int(matched) * routed.request.block_tokens


class StreamHandler:
    """Serves `envoy.service.ext_proc.v3.ExternalProcessor/Process`; one call per stream."""

    def __init__(
        self, router: Router, *, max_body_bytes: int, metrics: PickerMetrics | None = None
    ) -> None:
        self._router = router
        self._max_body = max_body_bytes
        self._metrics = metrics if metrics is not None else PickerMetrics()
        self._warned: set[int] = set()  # body modes already logged as "routing on headers"

    async def process(
        self, requests: AsyncIterator[wire.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wire.ProcessingResponse]:
        state = _Stream(self._router, self._max_body, self._metrics, self._warned)
        try:
            async for msg in requests:
                for resp in await state.on_message(msg):
                    yield resp
                if state.done:
                    return
        finally:
            state.close()


class _Stream:
    __slots__ = (
        "body_len",
        "chunks",
        "done",
        "explain",
        "headers",
        "max_body",
        "metrics",
        "mode",
        "response_mode",
        "routed",
        "router",
        "subset",
        "warned",
    )

    def __init__(
        self, router: Router, max_body: int, metrics: PickerMetrics, warned: set[int]
    ) -> None:
        self.router = router
        self.max_body = max_body
        self.metrics = metrics
        self.warned = warned
        self.mode = _FULL_DUPLEX  # what gateways use when Envoy does not say
        self.response_mode = _FULL_DUPLEX
        self.headers: dict[str, str] = {}
        self.subset: frozenset[str] | None = None
        self.chunks: list[bytes] = []
        self.body_len = 0
        self.routed: Routed | None = None
        self.explain = False
        self.done = False

    async def on_message(self, msg: wire.ProcessingRequest) -> list[wire.ProcessingResponse]:
        try:
            return await self._dispatch(msg)
        except ExtprocError as err:
            return self._fail(err)
        except Exception:
            log.exception("internal error", extra={"request_id": self.headers.get("x-request-id")})
            return self._fail(ExtprocError())

    def _fail(self, err: ExtprocError) -> list[wire.ProcessingResponse]:
        # An ImmediateResponse ends the HTTP exchange; Envoy sends nothing more for it.
        self.done = True
        self.chunks = []
        self.metrics.rejected(err.status)
        log.info(
            "rejected",
            extra={
                "request_id": self.headers.get("x-request-id"),
                "status": err.status,
                "code": err.code,
            },
        )
        extra = dict(err.extra_headers)
        if err.status == 429:
            extra[protocol.DROPPED_REASON_HEADER] = err.code
        return [wire.error_response(err, extra)]

    async def _dispatch(self, msg: wire.ProcessingRequest) -> list[wire.ProcessingResponse]:
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            return await self._on_request_headers(msg)
        if kind == "request_body":
            return await self._on_request_body(msg.request_body)
        if kind == "request_trailers":
            return await self._on_request_trailers()
        if kind == "response_headers":
            return [self._on_response_headers(msg)]
        if kind == "response_body":
            if self.response_mode == _FULL_DUPLEX:
                # Envoy forwards only what we send back: each chunk returns as it came.
                return [wire.echo_response_body(msg.response_body)]
            return [wire.CONTINUE_RESPONSE_BODY]
        if kind == "response_trailers":
            return [wire.CONTINUE_RESPONSE_TRAILERS]
        return []

    async def _on_request_headers(self, msg: wire.ProcessingRequest) -> list:
        if msg.HasField("protocol_config"):
            self.mode = msg.protocol_config.request_body_mode
            self.response_mode = msg.protocol_config.response_body_mode
        headers = wire.header_map(msg.request_headers.headers)
        # The picker alone chooses the upstream: whatever the client sent is dropped here,
        # and the decision overwrites the header on the way out.
        for name in protocol.PICKER_OWNED_HEADERS:
            headers.pop(name, None)
        if protocol.REQUEST_ID_HEADER not in headers:
            headers[protocol.REQUEST_ID_HEADER] = uuid.uuid4().hex
        self.explain = headers.get(protocol.EXPLAIN_HEADER, "") in ("1", "true")
        self.headers = headers
        self.subset = wire.subset_hint(msg)
        declared = headers.get("content-length", "")
        # isascii too: str.isdigit() accepts digits int() rejects ('²'), a 500 from a header.
        if declared.isascii() and declared.isdigit() and int(declared) > self.max_body:
            raise PayloadTooLarge(f"request body exceeds the {self.max_body}-byte limit")
        if self.mode not in (_FULL_DUPLEX, *_BUFFERED):
            # This body mode never shows us the whole body: decide on headers alone.
            self._without_body()
            return [self._override(wire.routed_headers(await self._route(None)))]
        if msg.request_headers.end_of_stream:
            return [self._override(wire.routed_headers(await self._route(b"")))]
        if self.mode == _FULL_DUPLEX:
            return []  # the header reply waits for the body
        return [self._override(wire.CONTINUE_REQUEST_HEADERS)]

    def _override(self, resp: wire.ProcessingResponse) -> wire.ProcessingResponse:
        """The request-header reply, with a request for the cheapest response mode where Envoy
        could honour one (never with a FULL_DUPLEX body mode: Envoy ignores it there)."""
        if _FULL_DUPLEX in (self.mode, self.response_mode) or self.response_mode == _NO_BODY:
            return resp
        out = wire.ProcessingResponse()
        out.CopyFrom(resp)  # the shared CONTINUE constants stay untouched
        out.mode_override.CopyFrom(wire.cheapest_response_mode(self.mode))
        return out

    def _without_body(self) -> None:
        mode = int(self.mode)
        # A peer may announce a value Envoy does not define: a label, never an error.
        name = wire.BodySendMode.Name(mode) if mode in wire.BodySendMode.values() else str(mode)
        self.metrics.without_body.labels(name).inc()
        if mode not in self.warned:
            self.warned.add(mode)
            log.warning(
                "the proxy's request body mode %s never shows the whole body: routing on "
                "headers alone, without prefix affinity (counted in "
                "extproc_decisions_without_body)",
                name,
            )

    async def _on_request_body(self, body: wire.pb.HttpBody) -> list:
        if self.routed is not None:
            # Decided at header time (STREAMED mode): chunks pass through untouched.
            return [wire.CONTINUE_REQUEST_BODY]
        chunk = body.body
        self.body_len += len(chunk)
        if self.body_len > self.max_body:
            raise PayloadTooLarge(f"request body exceeds the {self.max_body}-byte limit")
        if chunk:
            self.chunks.append(chunk)
        if not body.end_of_stream:
            if self.mode == _PARTIAL:
                # Envoy cut the body at its buffer limit and waits for this reply; the rest
                # streams past us. A cut JSON document cannot be parsed: route on headers.
                self.chunks = []
                self._without_body()
                return [wire.routed_body(await self._route(None))]
            return []  # FULL_DUPLEX: more chunks follow (bounded by max_body)
        return await self._body_complete(trailers_follow=False)

    async def _on_request_trailers(self) -> list:
        if self.routed is None and self.mode == _FULL_DUPLEX:
            out = await self._body_complete(trailers_follow=True)
            out.append(wire.CONTINUE_REQUEST_TRAILERS)
            return out
        return [wire.CONTINUE_REQUEST_TRAILERS]

    async def _body_complete(self, *, trailers_follow: bool) -> list:
        body = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks = []
        decision = await self._route(body)
        if self.mode in _BUFFERED:
            return [wire.routed_body(decision)]
        out = [wire.routed_headers(decision)]
        out.extend(wire.streamed_body(body, end_of_stream=not trailers_follow))
        return out

    async def _route(self, body: bytes | None) -> Decision:
        if self.routed is not None:
            # Envoy sends one request per stream; a peer that sends another gets it routed,
            # but never at the cost of leaking the first one's in-flight count.
            self.router.finish(self.routed)
            self.routed = None
        path = self.headers.get(":path", "/")
        explain = self.explain or log.isEnabledFor(logging.DEBUG)
        start = time.perf_counter()
        routed = await self.router.route(
            path, self.headers, body, subset=self.subset, explain=explain
        )
        self.metrics.decision_seconds.observe(time.perf_counter() - start)
        self.metrics.routed.inc()
        self.routed = routed
        if explain:
            log.debug("decision", extra={"decision": explanation(routed)})
        return routed.decision

    def _on_response_headers(self, msg: wire.ProcessingRequest) -> wire.ProcessingResponse:
        routed = self.routed
        if routed is None:
            return wire.CONTINUE_RESPONSE_HEADERS
        served = wire.served_endpoint(msg)
        if served is not None and served != routed.placement.address:
            routed = self.routed = self.router.served(routed, served)
        self.router.responded(routed)
        extra = dict(routed.decision.response_headers)
        if self.explain:
            extra[protocol.DECISION_HEADER] = orjson.dumps(explanation(routed)).decode()
        return wire.response_headers_with(extra) if extra else wire.CONTINUE_RESPONSE_HEADERS

    def close(self) -> None:
        """The stream ended, however it ended: release what the decision placed."""
        if self.routed is not None:
            self.router.finish(self.routed)
            self.routed = None
