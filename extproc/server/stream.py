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
plus what the decision sends back to the client (a session token; the explanation for an
operator's token in `x-extproc-explain`); FULL_DUPLEX_STREAMED body chunks are echoed unchanged
and in order (Envoy drops its copy and waits for ours); other body modes get CONTINUE; trailers
get their reply. Where neither body mode is FULL_DUPLEX_STREAMED, the request-header reply
carries a `mode_override` asking for no response body or trailers (honoured when the gateway
sets `allow_mode_override`, ignored otherwise). The served endpoint the proxy reports on the
response headers (`envoy.lb` metadata) takes over the in-flight count and the index entry.

Hostile peers (issue 18): every stream's buffered body counts against one process-wide budget
and must be complete within the body deadline (`limits`); a stream carries one request (a
second request_headers is refused); peers off the allow-list and undecodable messages are
refused before any state is kept (`guard`). Explanations go only to callers presenting an
operator-issued token in `x-extproc-explain` (`server.explain_tokens`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import grpc
import orjson

from extproc import protocol
from extproc.core import Api, Decision
from extproc.endpoints.request_end import Ended
from extproc.errors import (
    BadRequest,
    BodyBudgetExhausted,
    ExtprocError,
    PayloadTooLarge,
    RequestTimeout,
    StreamsFull,
)
from extproc.flowcontrol.engine_priority import ENGINE_PRIORITY_HEADER, BodyEdit, EngineEdit
from extproc.requests.parse import api_for_path
from extproc.router import Routed, Router
from extproc.server import wire
from extproc.server.cut_streams import CutStreams
from extproc.server.drain import StreamPhase
from extproc.server.families import one
from extproc.server.guard import PeerAllowList, Throttle
from extproc.server.limits import BodyBudget, BodyDeadline, DeadlineSweeper
from extproc.server.metrics import PickerMetrics

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from extproc.config import ServerSettings
    from extproc.flowcontrol.tickets import Ticket
    from extproc.server.llmd_metrics import RequestMetrics

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
        "terms": {k: {a: dict(t) for a, t in v.items()} for k, v in d.terms.items()},
        "prefix_blocks": dict(routed.lookup.matches),
        "request_blocks": len(routed.request.block_keys),
        "index_degraded": routed.lookup.degraded,
        "lookup_s": round(routed.lookup_s, 6),
        # Which picker process decided: with several replicas behind one proxy, a trace
        # tells their decisions apart by it.
        "picker": os.getpid(),
        "prompt_tokens": routed.request.prompt_tokens,
        "predicted_cached_tokens": predicted_cached_tokens(routed),
        # Seconds flow control held it in the picker's queue (None: flow control off).
        "queue_wait_s": routed.ticket.waited_s if routed.ticket is not None else None,
        # The tokens flow control counted for it (uncached prompt estimate + output).
        "flow_tokens": routed.ticket.request.tokens if routed.ticket is not None else None,
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
    """Serves `envoy.service.ext_proc.v3.ExternalProcessor/Process`; one call per stream.

    `budget`: the process-wide body budget (default: unbounded beyond `max_body_bytes` per
    stream). `body_timeout_s`: request headers to end of body. `explain_tokens`: values of
    `x-extproc-explain` that get the decision back (empty: nobody). `allow`: peers that may
    open streams. `max_streams`: streams open at once; past it a new one answers its first
    message with 503 `picker_streams_full` (None: unbounded)."""

    def __init__(
        self,
        router: Router,
        *,
        max_body_bytes: int,
        metrics: PickerMetrics | None = None,
        budget: BodyBudget | None = None,
        body_timeout_s: float = 30.0,
        explain_tokens: frozenset[str] = frozenset(),
        allow: PeerAllowList | None = None,
        max_streams: int | None = None,
    ) -> None:
        self._router = router
        self._max_streams = max_streams if max_streams is not None else 1 << 62
        self.streams_refused = 0
        self._max_body = max_body_bytes
        self._metrics = metrics if metrics is not None else PickerMetrics()
        self.budget = budget or BodyBudget(limit=1 << 62)
        self._body_timeout_s = body_timeout_s
        self._explain_tokens = tuple(t.encode() for t in explain_tokens)
        self._allow = allow or PeerAllowList()
        self._throttle = Throttle()
        self._warned: set[int] = set()  # body modes already logged as "routing on headers"
        self._replies = wire.DecisionReplies()
        self._sweeper = DeadlineSweeper(min(1.0, body_timeout_s / 4))
        # The open streams' states: a draining picker waits for them (server/lifecycle.py)
        # and reads what phase each is in (server/drain.py).
        self.live: set[_Stream] = set()
        # Streams held past their response headers for eviction; a drain ends them with OK.
        self.cuts = CutStreams()

    @classmethod
    def from_settings(
        cls, router: Router, cfg: ServerSettings, metrics: PickerMetrics
    ) -> StreamHandler:
        """The servicer with the hostile-client limits of `server:` applied (the budget's
        gauges, the held cuttable streams' and the open and refused streams' registered in
        `metrics`)."""
        budget = BodyBudget(limit=cfg.body_budget_bytes)
        metrics.add_collector(budget.collect)
        handler = cls(
            router,
            max_body_bytes=cfg.max_body_bytes,
            metrics=metrics,
            budget=budget,
            body_timeout_s=cfg.body_timeout_s,
            explain_tokens=frozenset(cfg.explain_tokens),
            allow=PeerAllowList.parse(cfg.allowed_clients),
            max_streams=cfg.max_streams,
        )
        metrics.add_collector(handler.cuts.collect)
        metrics.add_collector(handler.collect)
        return handler

    @property
    def open_streams(self) -> int:
        return len(self.live)

    def collect(self) -> Iterator[Metric]:
        """Metric families for the picker's registry: the streams open and refused."""
        yield one("extproc_streams_open", "ext_proc streams open now (bounded by "
                  "server.max_streams).", self.open_streams)  # fmt: skip
        yield one(
            "extproc_streams_refused",
            "Requests refused with 503 picker_streams_full: server.max_streams streams were "
            "open (logged).",
            self.streams_refused,
            "counter",
        )

    async def process(
        self, requests: AsyncIterator[wire.ProcessingRequest | None], context
    ) -> AsyncIterator[wire.ProcessingResponse]:
        if not self._allow.allows(context.peer()):
            self._warn("peer_refused", "ext_proc stream refused: peer not on the allow-list")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "peer not allowed")
        state = _Stream(
            self._router,
            self._max_body,
            self._metrics,
            self._warned,
            self.budget,
            self._explain_tokens,
            self._replies,
            self._throttle,
            self.cuts,
        )
        deadline = BodyDeadline(
            self._body_timeout_s, task=asyncio.current_task(), sweeper=self._sweeper
        )
        state.deadline = deadline
        it = aiter(requests)
        full = self.open_streams >= self._max_streams
        self.live.add(state)
        try:
            if full:
                for resp in await self._refuse(state, it):
                    yield resp
                return
            while True:
                left = deadline.remaining()
                msg: wire.ProcessingRequest | None
                try:
                    if state.eviction is not None:
                        # An evictable request (flow control): its eviction may come first.
                        got = await _next_or_evicted(it, state.eviction)
                        if got is None:
                            if state.released:
                                return  # a drain ended it: OK, the response runs on
                            for resp in state.evicted():
                                yield resp
                            return
                        msg = got
                    elif left is None:
                        msg = await anext(it)
                    elif left <= 0:
                        raise TimeoutError
                    else:
                        # The sweeper cuts this read at the deadline (`limits`).
                        deadline.reading = True
                        try:
                            msg = await anext(it)
                        except asyncio.CancelledError:
                            if not deadline.take_fired():
                                raise
                            raise TimeoutError from None
                        finally:
                            deadline.reading = False
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    self.budget.timed_out += 1
                    for resp in state.fail(
                        RequestTimeout(
                            f"request body not received within {self._body_timeout_s:g} s"
                        )
                    ):
                        yield resp
                    return
                if msg is None:
                    self._warn("malformed", "ext_proc message could not be decoded; stream ended")
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed message")
                    return  # abort raises; this tells the type checker msg is set below
                for resp in await state.on_message(msg):
                    yield resp
                if state.done:
                    return
        finally:
            self.live.discard(state)
            state.close()

    async def _refuse(
        self, state: _Stream, it: AsyncIterator[wire.ProcessingRequest | None]
    ) -> list[wire.ProcessingResponse]:
        """Past `max_streams`: the first message (Envoy sends the request headers at once)
        gets the 503 and the stream ends, so the client hears why, whatever the gateway's
        failure mode; a peer that sends nothing is let go at the body deadline."""
        self.streams_refused += 1
        self._warn(
            "streams_full",
            f"requests refused: {self._max_streams} ext_proc streams open (server.max_streams; "
            f"{self.streams_refused} refused in total, extproc_streams_refused)",
        )
        try:
            async with asyncio.timeout(self._body_timeout_s):
                msg = await anext(it)
        except (StopAsyncIteration, TimeoutError):
            return []
        if msg is not None and msg.WhichOneof("request") == "request_headers":
            state.headers = wire.header_map(msg.request_headers.headers)
        return state.fail(StreamsFull("the endpoint picker has too many requests open"))

    def _warn(self, key: str, message: str) -> None:
        self._throttle.warn(log, key, message)


async def _next_or_evicted(
    it: AsyncIterator[wire.ProcessingRequest | None], evicted: asyncio.Future[None]
) -> wire.ProcessingRequest | None:
    """The next message from Envoy, or None when the eviction signal comes first (the read
    is then abandoned: the stream ends with the eviction answer)."""
    if evicted.done():
        return None
    reader = asyncio.ensure_future(anext(it))
    try:
        await asyncio.wait((reader, evicted), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not reader.done():
            reader.cancel()
        elif not reader.cancelled():
            # Envoy half-closes then resets: the read may end (StopAsyncIteration) just as
            # this call is cancelled. Retrieved here, or asyncio logged an ERROR per stream.
            reader.exception()
    if reader.done() and not reader.cancelled():
        return reader.result()  # a message (or StopAsyncIteration) wins a tie
    return None


class _Stream:
    __slots__ = (
        "body_len",
        "budget",
        "chunks",
        "cut_ticket",
        "cuts",
        "deadline",
        "done",
        "eviction",
        "explain",
        "explain_tokens",
        "headers",
        "max_body",
        "metrics",
        "mode",
        "obs",
        "released",
        "replies",
        "responded",
        "response_mode",
        "routed",
        "router",
        "seen_request",
        "subset",
        "throttle",
        "warned",
    )

    def __init__(
        self,
        router: Router,
        max_body: int,
        metrics: PickerMetrics,
        warned: set[int],
        budget: BodyBudget,
        explain_tokens: tuple[bytes, ...] = (),
        replies: wire.DecisionReplies | None = None,
        throttle: Throttle | None = None,
        cuts: CutStreams | None = None,
    ) -> None:
        self.router = router
        self.cuts = cuts if cuts is not None else CutStreams()
        self.released = False  # a drain ended the stream (server/cut_streams.py)
        # The handler's, shared by every stream (one per stream would throttle nothing).
        self.throttle = throttle if throttle is not None else Throttle()
        self.replies = replies if replies is not None else wire.DecisionReplies()
        self.budget = budget
        self.explain_tokens = explain_tokens
        self.deadline: BodyDeadline | None = None
        self.seen_request = False
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
        self.responded = False  # the response headers came (the proxy may skip them)
        self.eviction: asyncio.Future[None] | None = None
        # Released at its response headers but still cuttable until the stream ends.
        self.cut_ticket: Ticket | None = None
        self.explain = False
        self.done = False
        self.obs = metrics.llmd.request()  # llm-d's request families (server/llmd_metrics.py)

    async def on_message(self, msg: wire.ProcessingRequest) -> list[wire.ProcessingResponse]:
        try:
            return await self._dispatch(msg)
        except ExtprocError as err:
            return self.fail(err)
        except Exception as exc:
            self.metrics.internal_errors.inc()
            # With its traceback, but once per 10 s per exception type: a fault met by every
            # request (a broken plugin, a bad state) wrote one traceback per request.
            self.throttle.exception(
                log,
                f"internal error {type(exc).__name__}",
                "internal error",
                extra={"request_id": self.headers.get(protocol.REQUEST_ID_HEADER)},
            )
            return self.fail(ExtprocError())

    def _release_body(self) -> None:
        """Give the buffered chunks back to the budget (body complete, failed or gone)."""
        self.budget.give(sum(len(c) for c in self.chunks))
        self.chunks = []
        if self.deadline is not None:
            self.deadline.stop()

    def fail(self, err: ExtprocError) -> list[wire.ProcessingResponse]:
        # An ImmediateResponse ends the HTTP exchange; Envoy sends nothing more for it.
        self.done = True
        self._release_body()
        self.metrics.rejected(err.status)
        self.obs.failed(err.status, err.model, self.headers)
        log.info(
            "rejected",
            extra={
                "request_id": self.headers.get(protocol.REQUEST_ID_HEADER),
                "status": err.status,
                "code": err.code,
            },
        )
        extra = dict(err.extra_headers)
        if err.status in (429, 503):
            # A refusal with its reason: 503s too (no endpoint, body budget), so a client
            # (and the overload bench) can tell a refusal from a failure.
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
            headers = msg.response_headers.headers
            self.obs.response(wire.header_value(headers, ":status"),
                              wire.header_value(headers, "content-length"))  # fmt: skip
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
        if self.seen_request:
            # Envoy opens one stream per HTTP request. A peer sending more would get a
            # decision (an index write, an in-flight charge) per message from one stream.
            raise BadRequest("one request per ext_proc stream")
        self.seen_request = True
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
        self.explain = self._explain_allowed(headers.get(protocol.EXPLAIN_HEADER))
        self.headers = headers
        self.subset = wire.subset_hint(msg)
        declared = headers.get("content-length", "")
        # isascii too: str.isdigit() accepts digits int() rejects ('²'), a 500 from a header.
        if declared.isascii() and declared.isdigit() and int(declared) > self.max_body:
            raise PayloadTooLarge(f"request body exceeds the {self.max_body}-byte limit")
        if self.mode not in (_FULL_DUPLEX, *_BUFFERED):
            # This body mode never shows us the whole body: decide on headers alone.
            self._without_body()
            decision = await self._route(None)
            return [
                self._override(_edited(self.replies.headers(decision), self._engine_edit(None)))
            ]
        if msg.request_headers.end_of_stream:
            decision = await self._route(b"")
            return [self._override(_edited(self.replies.headers(decision), self._engine_edit(b"")))]
        if self.deadline is not None:
            self.deadline.start()
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

    def _explain_allowed(self, presented: str | None) -> bool:
        """Only a token the operator issued gets explanations (they reveal every endpoint,
        score and per-endpoint prefix match: an oracle for other users' prompts)."""
        if not presented or not self.explain_tokens:
            return False
        value = presented.encode()
        # compare_digest on every token: no early exit that times which one matched.
        return any([hmac.compare_digest(value, t) for t in self.explain_tokens])

    async def _on_request_body(self, body: wire.pb.HttpBody) -> list:
        if self.routed is not None:
            # Decided at header time (STREAMED mode): chunks pass through untouched.
            return [wire.CONTINUE_REQUEST_BODY]
        chunk = body.body
        self.body_len += len(chunk)
        if self.body_len > self.max_body:
            raise PayloadTooLarge(f"request body exceeds the {self.max_body}-byte limit")
        if chunk:
            if not self.budget.take(len(chunk)):
                raise BodyBudgetExhausted("the picker is buffering too many request bodies")
            self.chunks.append(chunk)
        if not body.end_of_stream:
            if self.mode == _PARTIAL:
                # Envoy cut the body at its buffer limit and waits for this reply; the rest
                # streams past us. A cut JSON document cannot be parsed: route on headers.
                self._release_body()
                self._without_body()
                decision = await self._route(None)
                return [_edited(self.replies.body(decision), self._engine_edit(None))]
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
        try:
            decision = await self._route(body)
        finally:
            self._release_body()  # held through parsing: the joined copy lives until then
        edit = self._engine_edit(body)
        if edit is not None and edit.body is not None:
            return self._with_body_edit(decision, body, edit.body, trailers_follow)
        if self.mode in _BUFFERED:
            return [_edited(self.replies.body(decision), edit)]
        out = [_edited(self.replies.headers(decision), edit)]
        out.extend(wire.streamed_body(body, end_of_stream=not trailers_follow))
        return out

    def _engine_edit(self, body: bytes | None) -> EngineEdit | None:
        """What flow control's engine priority does to this decided request
        (`flowcontrol/engine_priority.py`; None: the setting is off). Whatever it does, the
        client's `x-vllm-priority` (read before the body by vLLM) never reaches the engine
        as the client sent it."""
        admission = self.router.admission
        engine = admission.engine_priority if admission is not None else None
        if engine is None:
            return None
        routed = self.routed
        if routed is None or routed.ticket is None:
            return engine.plan(Api.UNKNOWN, None, body, client_set=False)
        req = routed.request
        api = req.api
        if api is Api.UNKNOWN:
            # Decided without a body (the router parses none): the path still names the
            # API, and the header form needs nothing else.
            api = api_for_path(self.headers.get(":path", "/"))
        band = routed.ticket.request.priority
        return engine.plan(api, band, body, client_set=req.client_priority)

    def _with_body_edit(
        self, decision: Decision, body: bytes, edit: BodyEdit, trailers_follow: bool
    ) -> list[wire.ProcessingResponse]:
        """The decision with flow control's band written into the body as the engine's
        `priority`, and the client's `x-vllm-priority` removed."""
        remove = (ENGINE_PRIORITY_HEADER,)
        sized: dict[str, str] = {}
        if "content-length" in self.headers:
            sized["content-length"] = str(edit.length(len(body)))
        if self.mode in _BUFFERED:
            return [
                wire.with_request_edit(
                    self.replies.body(decision),
                    set_headers=sized,
                    remove_headers=remove,
                    body=edit.join(body),
                )
            ]
        out = [
            wire.with_request_edit(
                self.replies.headers(decision), set_headers=sized, remove_headers=remove
            )
        ]
        out.extend(
            wire.streamed_body(
                body, end_of_stream=not trailers_follow, head=edit.head, rest_from=edit.rest_from
            )
        )
        return out

    async def _route(self, body: bytes | None) -> Decision:
        if self.routed is not None:
            # Unreachable while a second request_headers is refused; kept so a future path
            # that routes twice can never leak the first decision's in-flight count.
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
        req = routed.request
        self.obs.routed(req.model, self.headers, self.body_len, req.prompt_tokens)
        self.routed = routed
        ticket = routed.ticket
        if ticket is not None and ticket.evictable:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

            def signal() -> None:
                if not fut.done():
                    fut.set_result(None)

            ticket.on_evict(signal)
            self.eviction = fut
        if explain:
            log.debug("decision", extra={"decision": explanation(routed)})
        return routed.decision

    def evicted(self) -> list[wire.ProcessingResponse]:
        """Flow control cut this running request for higher-priority work: 429 `evicted`
        before the response headers. After them the same answer makes Envoy reset the
        client's stream and the model server's (the client sees a truncated response, the
        engine aborts the request); no 429 reaches anyone, so none is counted."""
        admission = self.router.admission
        assert admission is not None  # only flow control sets `eviction`
        err = admission.evicted_error()
        if not self.responded:
            return self.fail(err)
        self.done = True
        log.info(
            "evicted mid-response: the proxy resets it",
            extra={"request_id": self.headers.get(protocol.REQUEST_ID_HEADER)},
        )
        return [wire.error_response(err, {protocol.DROPPED_REASON_HEADER: err.code})]

    def _on_response_headers(self, msg: wire.ProcessingRequest) -> wire.ProcessingResponse:
        routed = self.routed
        if routed is None:
            return wire.CONTINUE_RESPONSE_HEADERS
        self.responded = True
        served = wire.served_endpoint(msg)
        if served is not None and served != routed.placement.address:
            routed = self.routed = self.router.served(routed, served)
        self.router.responded(routed)
        extra = dict(routed.decision.response_headers)
        if self.explain:
            extra[protocol.DECISION_HEADER] = orjson.dumps(explanation(routed)).decode()
        resp = wire.response_headers_with(extra) if extra else wire.CONTINUE_RESPONSE_HEADERS
        if self.mode != _FULL_DUPLEX or self.response_mode != _NO_BODY:
            # The stream lasts to the response's end (response bodies sent, or a buffered
            # request body: Envoy 1.40 keeps it open then): accounting ends there, as ever.
            # What ends it needs the placement and block keys, not the parsed prompt (about
            # the body's size: 37 KiB a stream for 40 KB prompts, bench_held_streams.py).
            self.routed = _without_prompt(routed)
            return resp
        # `extproc envoy-config` (FULL_DUPLEX_STREAMED request body, no response body): Envoy
        # closed the stream here with trailers SKIP, and the request's accounting (in-flight
        # hold, flow-control release) still ends here with trailers SEND, where the stream
        # lasts to the response's end; an evictable request stays cuttable until then.
        cuttable = (
            self.eviction is not None
            and not msg.response_headers.end_of_stream
            and self.cuts.hold(self._let_go)
        )
        self.routed = None
        self.router.finish(routed, cuttable=cuttable)
        if cuttable:
            self.cut_ticket = routed.ticket
        else:
            # Nothing can cut this response: end the stream with OK now. Envoy runs the
            # response on untouched, where an open stream would be reset if this picker died
            # (with trailers SKIP Envoy has closed its side already).
            self.done = True
        return resp

    @property
    def phase(self) -> StreamPhase:
        """Where this open stream is, for a drain (server/drain.py): a response whose body
        passes through the picker (the gateways' FULL_DUPLEX_STREAMED response bodies: the
        stream lasts to the response's end), before it, or one whose response body does not
        (`extproc envoy-config`: the stream ends at the response headers)."""
        if not self.seen_request or self.response_mode != _FULL_DUPLEX:
            return "no_response_body"
        return "response_body" if self.responded else "before_response_body"

    def _let_go(self) -> None:
        """A drain: end this cuttable stream with OK (it stops being an eviction candidate
        in `close`), so the picker's exit does not reset its response."""
        self.released = True
        if self.eviction is not None and not self.eviction.done():
            self.eviction.set_result(None)

    def close(self) -> None:
        """The stream ended, however it ended: release what the decision placed. Without
        the response headers (the proxy skips that phase), llm-d's request families wait
        for the access-log entry: its status and size stand in for the headers'."""
        self._release_body()
        ticket, self.cut_ticket = self.cut_ticket, None
        if ticket is not None:
            self.cuts.drop(self._let_go)
            admission = self.router.admission
            assert admission is not None  # only flow control sets `eviction`
            admission.stream_ended(ticket)
        routed, self.routed = self.routed, None
        if routed is None or self.responded:
            self.obs.close()
            if routed is not None:
                self.router.finish(routed)
            return
        # The obs alone, not this stream: the hold lasts the whole request.
        self.router.finish(routed, responded=False, then=functools.partial(_ended, self.obs))


def _without_prompt(routed: Routed) -> Routed:
    """`routed` without its request's parsed prompt, for a stream held to the response's end
    (the decision and the plugins that learn from the response headers have had it)."""
    if routed.request.prompt is None:
        return routed
    return dataclasses.replace(routed, request=dataclasses.replace(routed.request, prompt=None))


def _edited(resp: wire.ProcessingResponse, edit: EngineEdit | None) -> wire.ProcessingResponse:
    """A decision reply with engine priority's header edit (the reply as it is without one:
    the cached replies are copied only when something changes)."""
    if edit is None:
        return resp
    return wire.with_request_edit(
        resp, set_headers=dict(edit.set_headers), remove_headers=edit.remove_headers
    )


def _ended(obs: RequestMetrics, entry: Ended | None) -> None:
    """llm-d's request families of a stream that never saw its response headers, closed with
    the access-log entry (status and size), or without it when none came."""
    if entry is not None and entry.status is not None:
        obs.response(str(entry.status), str(entry.response_bytes))
    obs.close()
