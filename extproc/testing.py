"""Test support shipped with the package: build ext_proc messages the way Envoy sends them and
drive a real picker over real gRPC; build requests, candidates, a registry and a manual clock to
unit-test a plugin. Used by our tests and by plugin authors' tests."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from extproc import protocol
from extproc.server import wire

if TYPE_CHECKING:
    from extproc.config import Settings
    from extproc.core import Candidate, InferenceRequest
    from extproc.scheduling.registry import PluginRegistry
    from extproc.server.app import App

T = TypeVar("T")

pb = wire.pb
FULL_DUPLEX = pb.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = pb.ProcessingMode.BUFFERED
NONE = pb.ProcessingMode.NONE


def request_headers(
    headers: Mapping[str, str],
    *,
    end_of_stream: bool = False,
    mode: int | None = FULL_DUPLEX,
    subset: Sequence[str] | None = None,
    response_mode: int | None = None,
) -> pb.ProcessingRequest:
    """The first message of a stream. `mode=None` leaves protocol_config out (older Envoys);
    `response_mode` is the response body mode announced alongside (default NONE)."""
    msg = pb.ProcessingRequest()
    hm = msg.request_headers.headers
    for k, v in headers.items():
        hm.headers.add(key=k.lower(), raw_value=v.encode())
    msg.request_headers.end_of_stream = end_of_stream
    if mode is not None:
        msg.protocol_config.request_body_mode = mode
        if response_mode is not None:
            msg.protocol_config.response_body_mode = response_mode  # type: ignore[assignment]
    if subset is not None:
        msg.metadata_context.filter_metadata[protocol.SUBSET_HINT_NAMESPACE].update(
            {protocol.SUBSET_HINT_KEY: list(subset)}
        )
    return msg


def request_body(data: bytes, *, end_of_stream: bool) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    msg.request_body.body = data
    msg.request_body.end_of_stream = end_of_stream
    return msg


def body_chunks(data: bytes, chunk_bytes: int = 16_384) -> list[pb.ProcessingRequest]:
    """A body split as Envoy streams it; the last chunk carries end_of_stream."""
    n = max(1, -(-len(data) // chunk_bytes))
    return [
        request_body(data[i * chunk_bytes : (i + 1) * chunk_bytes], end_of_stream=i == n - 1)
        for i in range(n)
    ]


def request_trailers(trailers: Mapping[str, str] | None = None) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    msg.request_trailers.SetInParent()
    for k, v in (trailers or {}).items():
        msg.request_trailers.trailers.headers.add(key=k, raw_value=v.encode())
    return msg


def response_headers(status: int = 200, *, served: str | None = None) -> pb.ProcessingRequest:
    """`served`: the endpoint the proxy reports in `envoy.lb` (forwarding_namespaces)."""
    msg = pb.ProcessingRequest()
    msg.response_headers.headers.headers.add(key=":status", raw_value=str(status).encode())
    if served is not None:
        msg.metadata_context.filter_metadata[protocol.LB_NAMESPACE].update(
            {protocol.SERVED_KEY: served}
        )
    return msg


def response_body(data: bytes, *, end_of_stream: bool) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    msg.response_body.body = data
    msg.response_body.end_of_stream = end_of_stream
    return msg


def response_trailers() -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    msg.response_trailers.SetInParent()
    return msg


def post(path: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Pseudo-headers and content-type of a JSON POST, as Envoy presents them."""
    return {
        ":method": "POST",
        ":path": path,
        ":authority": "gateway",
        ":scheme": "http",
        "content-type": "application/json",
        **(extra or {}),
    }


def destination(resp: pb.ProcessingResponse) -> str | None:
    """The destination a header or body response sets, or None."""
    kind = resp.WhichOneof("response")
    if kind not in ("request_headers", "request_body"):
        return None
    common = getattr(resp, kind).response
    for opt in common.header_mutation.set_headers:
        if opt.header.key == protocol.DESTINATION_HEADER:
            return opt.header.raw_value.decode()
    return None


def lb_metadata(resp: pb.ProcessingResponse) -> str | None:
    ns = resp.dynamic_metadata.fields.get(protocol.LB_NAMESPACE)
    if ns is None:
        return None
    return ns.struct_value.fields[protocol.DESTINATION_KEY].string_value


class ExtProcClient:
    """Talks to a picker the way Envoy does, over a real gRPC channel."""

    def __init__(self, target: str) -> None:
        self._channel = grpc.aio.insecure_channel(target)
        self._process = self._channel.stream_stream(
            protocol.EXT_PROC_METHOD,
            request_serializer=pb.ProcessingRequest.SerializeToString,
            response_deserializer=pb.ProcessingResponse.FromString,
        )

    async def __aenter__(self) -> ExtProcClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._channel.close()

    async def exchange(
        self, messages: Iterable[pb.ProcessingRequest]
    ) -> list[pb.ProcessingResponse]:
        """Send every message, half-close, and collect every response until the picker ends
        the stream."""
        call = self._process()
        for m in messages:
            await call.write(m)
        await call.done_writing()
        return [r async for r in call]

    def open(self) -> grpc.aio.StreamStreamCall:
        """A raw stream, for tests that interleave reads and writes."""
        return self._process()


@dataclass
class ThreadedPicker:
    """A picker serving from a background thread's event loop, for synchronous callers
    (hypothesis tests, fuzzers) that drive it over real gRPC."""

    app: App
    loop: asyncio.AbstractEventLoop

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.app.port}"

    def exchange(
        self, messages: Iterable[pb.ProcessingRequest], *, timeout_s: float = 20.0
    ) -> list[pb.ProcessingResponse]:
        """One stream, blocking: send every message, half-close, collect every response."""
        with grpc.insecure_channel(self.target) as ch:
            call = ch.stream_stream(
                protocol.EXT_PROC_METHOD,
                request_serializer=pb.ProcessingRequest.SerializeToString,
                response_deserializer=pb.ProcessingResponse.FromString,
            )
            return list(call(iter(messages), timeout=timeout_s))

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn()` on the picker's loop (to read its state safely)."""

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(5)


@contextlib.contextmanager
def picker_in_thread(settings: Settings) -> Iterator[ThreadedPicker]:
    """Start an App for `settings` (its static endpoints) in a thread; stop it on exit."""
    from extproc.endpoints import parse_endpoints
    from extproc.server.app import App

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, Any] = {}

    async def main() -> None:
        async with App(settings, parse_endpoints(",".join(settings.endpoints))) as app:
            holder["app"], holder["stop"] = app, asyncio.Event()
            ready.set()
            await holder["stop"].wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    if not ready.wait(20):
        raise RuntimeError("picker did not start")
    try:
        yield ThreadedPicker(holder["app"], loop)
    finally:
        loop.call_soon_threadsafe(holder["stop"].set)
        thread.join(20)
        loop.close()


# --- Builders for plugin authors' unit tests (see extproc.plugins) ---------------------------


def make_request(
    *,
    blocks: int = 0,
    block_tokens: int = 64,
    tokens: int = 0,
    model: str = "m",
    media: Sequence[str] = (),
    headers: Mapping[str, str] | None = None,
    adapter: str | None = None,
    path: str = "/v1/chat/completions",
) -> InferenceRequest:
    """A parsed request as a plugin sees it: `blocks` chained prefix-block keys (1..blocks),
    `tokens` estimated prompt tokens, one 256-token image per entry of `media` (its content
    hash), request `headers` with lower-case names."""
    from extproc.core import Api, InferenceRequest, MediaItem, Modality

    return InferenceRequest(
        request_id="r",
        path=path,
        api=Api.CHAT,
        model=model,
        block_keys=tuple(range(1, blocks + 1)),
        block_tokens=block_tokens,
        prompt_tokens=tokens,
        media=tuple(MediaItem(Modality.IMAGE, h, 256) for h in media),
        headers=dict(headers or {}),
        lora_adapter=adapter,
    )


def make_candidate(
    address: str,
    *,
    prefix_blocks: float = 0.0,
    role: str | None = None,
    labels: Mapping[str, str] | None = None,
    **state: Any,
) -> Candidate:
    """An endpoint with live state as the scheduler sees it. `state` takes `EndpointState`
    fields (waiting, running, kv_usage, inflight_requests, ...); figures are fresh
    (scraped 10 ms ago) unless `age_s`/`is_stale` say otherwise."""
    from extproc.core import Candidate, Endpoint, EndpointState

    lab = dict(labels or {})
    if role is not None:
        lab["llm-d.ai/role"] = role
    state.setdefault("age_s", 0.01)
    state.setdefault("is_stale", state["age_s"] is None or state["age_s"] > 0.2)
    return Candidate(Endpoint(address, labels=lab), EndpointState(**state), prefix_blocks)


def plugin_registry(*classes: type) -> PluginRegistry:
    """The built-in plugins plus `classes`, validated as `extproc serve` validates them."""
    from extproc.scheduling.plugins import BUILTINS
    from extproc.scheduling.registry import PluginRegistry

    return PluginRegistry((*BUILTINS, *classes))


class ManualClock:
    """A clock that moves only when told: pass `clock` where a component takes one, then
    `advance(seconds)`."""

    def __init__(self, start: float = 1_750_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
