"""One simulated vLLM server over HTTP (aiohttp): the OpenAI routes, `/metrics`, `/health`,
`/reset_prefix_cache`, `/tokenize`, plus `GET /sim/cache` (the true cache state, for
tests and benchmarks) and `GET|POST /sim/speed` (`{"relative_speed": 0.25}`: slow the
server down or speed it up while running, as another tenant on its GPU would). Bodies are
read with extproc's own `parse_request`; the `engine` does the physics, `kvevents` the ZMQ
side.

    async with SimServer(ServerSettings(port=0)) as srv:
        ...  # srv.url, srv.kv_events_url, srv.replay_url
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any

import msgspec
import orjson
from aiohttp import web

from extproc.core import Api
from extproc.errors import BadRequest
from extproc.protocol import ENGINE_PRIORITY_HEADER
from extproc.requests import ParseSettings, parse_request
from extproc.sim import SERVED_BY_HEADER, TIMING_HEADER
from extproc.sim.blocks import wire_hash
from extproc.sim.engine import Chunk, Engine, EngineSettings, Job
from extproc.sim.kvevents import KVEventPublisher, KVEventsSettings
from extproc.sim.metrics import render
from extproc.sim.tokens import SimTokenizer

FINGERPRINT = "vllm-0.32.0-extproc-sim"
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's default for /v1/completions


class ServerSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One server. `port` 0 picks a free port. `name` (default `host:port`) is what the
    `x-served-by` header says. `kv_events`: None disables events; its `topic` None means
    llm-d's `kv@<host:port>@<model>`. `chat_max_tokens` (256) caps the chat default of
    max_model_len - prompt (vLLM's), so a client that forgets max_tokens is not stuck."""

    host: str = "127.0.0.1"
    port: int = 0
    name: str | None = None
    engine: EngineSettings = EngineSettings()
    kv_events: KVEventsSettings | None = None
    chat_max_tokens: int = 256


class _Sampling(msgspec.Struct):
    """The request fields the engine needs besides the prompt (parse_request owns the rest)."""

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    seed: int | None = None
    n: int = 1
    stream_options: _StreamOptions | None = None
    priority: int = 0  # vLLM's: lower first with --scheduling-policy priority


class _StreamOptions(msgspec.Struct):
    include_usage: bool = False


_SAMPLING = msgspec.json.Decoder(_Sampling)


def _priority(headers: dict[str, str], sampling: _Sampling) -> int:
    # vLLM 0.32 reads the header before the body's `priority` (an unparsable value is ignored).
    raw = headers.get(ENGINE_PRIORITY_HEADER)
    if raw is not None:
        try:
            return int(raw)
        except ValueError:
            pass
    return sampling.priority


class _Speed(msgspec.Struct, forbid_unknown_fields=True):
    relative_speed: Annotated[float, msgspec.Meta(gt=0, le=1000)]


class SimServer:
    """Owns one engine, its HTTP site and its event publisher, from `__aenter__` (sockets
    bound, ready to serve) to `__aexit__` (everything closed)."""

    def __init__(self, settings: ServerSettings, tokenizer: SimTokenizer | None = None) -> None:
        self.settings = settings
        self.tokenizer = tokenizer if tokenizer is not None else SimTokenizer()
        self.publisher: KVEventPublisher | None = None
        self.engine = Engine(settings.engine, self.tokenizer, self._publish)
        self.name = settings.name or ""
        self.url = ""
        self._parse = ParseSettings()
        self._runner: web.AppRunner | None = None
        self._stack = contextlib.AsyncExitStack()

    @property
    def kv_events_url(self) -> str | None:
        return self.publisher.url if self.publisher else None

    @property
    def replay_url(self) -> str | None:
        return self.publisher.replay_url if self.publisher else None

    def ready_line(self) -> str:
        s = self.settings.engine
        return (
            f"sim ready name={self.name} url={self.url} model={s.model} "
            f"kv_events={self.kv_events_url or '-'} replay={self.replay_url or '-'} "
            f"block_size={s.block_size} gpu_blocks={s.num_gpu_blocks} "
            f"speed={s.timing.speed:g}"
        )

    async def __aenter__(self) -> SimServer:
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def _start(self) -> None:
        s = self.settings
        # Closed after the HTTP runner (the stack unwinds backwards): its requests end first.
        self._stack.push_async_callback(self.engine.aclose)
        # A client that hangs up cancels its handler at once, as vLLM's API server does
        # (Starlette listens for the disconnect; AsyncLLM.generate aborts on the cancel):
        # without it aiohttp noticed only at the handler's next write, so a request cut
        # before its first token kept its KV and ran its whole prefill, delaying the ones
        # behind it (bench/RESULTS.md, issue 15, thirtieth session).
        runner = web.AppRunner(self._app(), access_log=None, handler_cancellation=True)
        await runner.setup()
        self._stack.push_async_callback(runner.cleanup)
        site = web.TCPSite(runner, s.host, s.port)
        await site.start()
        port = runner.addresses[0][1]
        host = f"[{s.host}]" if ":" in s.host else s.host
        self.url = f"http://{host}:{port}"
        self.name = s.name or f"{host}:{port}"
        if s.kv_events is not None:
            ev = s.kv_events
            if ev.topic is None:
                ev = msgspec.structs.replace(ev, topic=f"kv@{host}:{port}@{s.engine.model}")
            pub = KVEventPublisher(ev, s.engine.block_size)
            pub.start()
            self._stack.callback(pub.close)
            self.publisher = pub
            await self._stack.enter_async_context(_background(pub.run()))

    def _publish(self, events: Any) -> None:
        if self.publisher is not None:
            self.publisher.publish(events)

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/reset_prefix_cache", self._reset)
        app.router.add_post("/sim/restart", self._restart)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/sim/cache", self._cache)
        app.router.add_get("/sim/speed", self._speed)
        app.router.add_get("/sim/steps", self._steps)
        app.router.add_post("/sim/speed", self._set_speed)
        return app

    def _headers(self) -> dict[str, str]:
        return {SERVED_BY_HEADER: self.name}

    def _error(
        self, status: int, message: str, kind: str, param: str | None = None
    ) -> web.Response:
        body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
        return web.json_response(body, status=status, headers=self._headers(), dumps=_dumps)

    async def _read(self, request: web.Request) -> tuple[Any, _Sampling, Job]:
        """Body -> (parsed request, sampling fields, engine job); raises BadRequest."""
        body = await request.read()
        headers = {k.lower(): v for k, v in request.headers.items()}
        req = parse_request(request.path, headers, body, self._parse)
        try:
            sampling = _SAMPLING.decode(body)
        except msgspec.ValidationError as exc:
            raise BadRequest(f"invalid sampling parameters: {exc}") from None
        if sampling.n != 1:
            raise BadRequest("n: only 1 is supported by the simulator")
        if req.prompt is None:
            raise BadRequest("prompt: required")
        tokens = self.tokenizer.prompt_tokens(req.prompt)
        if not tokens.ids:
            raise BadRequest("prompt: must not be empty")
        max_tokens = sampling.max_completion_tokens or sampling.max_tokens
        if max_tokens is None:
            if req.api is Api.CHAT:
                free = self.settings.engine.max_model_len - len(tokens.ids)
                max_tokens = max(1, min(free, self.settings.chat_max_tokens))
            else:
                max_tokens = _COMPLETIONS_DEFAULT_MAX_TOKENS
        if max_tokens < 1:
            raise BadRequest("max_tokens: must be at least 1")
        self.engine.check(len(tokens.ids), max_tokens)
        job = Job(
            tokens,
            max_tokens,
            req.cache_salt,
            sampling.seed,
            req.stream,
            _priority(headers, sampling),
        )
        return req, sampling, job

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        received = time.time()  # wall clock: benchmarks on this host compare it to theirs
        try:
            req, sampling, job = await self._read(request)
        except BadRequest as exc:
            return self._error(400, exc.message, "BadRequestError")
        if req.model != self.settings.engine.model:
            return self._error(
                404, f"The model `{req.model}` does not exist.", "NotFoundError", "model"
            )
        chat = req.api is Api.CHAT
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        shape = _Shape(rid, int(time.time()), self.settings.engine.model, chat)
        stream = contextlib.aclosing(self.engine.generate(job))
        if not req.stream:
            ids: list[int] = []
            cached = 0
            async with stream as chunks:
                async for chunk in chunks:
                    ids += chunk.token_ids
                    cached = chunk.cached_tokens
            usage = _usage(len(job.tokens.ids), len(ids), cached)
            body = shape.full(self.tokenizer.decode(ids), usage)
            return web.Response(
                body=_dumps(body), content_type="application/json", headers=self._headers()
            )
        resp = web.StreamResponse(headers={**self._headers(), "Cache-Control": "no-cache"})
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        include_usage = bool(sampling.stream_options and sampling.stream_options.include_usage)
        # A client that hangs up ends the stream; the engine already gave its blocks back.
        with contextlib.suppress(ConnectionResetError):
            timing = request.headers.get(TIMING_HEADER) == "1"
            await self._stream(resp, shape, stream, job, include_usage, timing, received)
        return resp

    async def _stream(
        self,
        resp: web.StreamResponse,
        shape: _Shape,
        stream: contextlib.aclosing[AsyncGenerator[Chunk, None]],
        job: Job,
        include_usage: bool,
        timing: bool = False,
        received: float = 0.0,
    ) -> None:
        chat = shape.chat
        produced = 0
        last: Chunk | None = None
        async with stream as chunks:
            if chat:
                await resp.write(_sse(shape.delta({"role": "assistant", "content": ""}, None)))
            async for chunk in chunks:
                out = bytearray()
                if timing and chunk.timing is not None:
                    # Asked for with TIMING_HEADER: an SSE comment (clients skip it) saying
                    # where the first token's time went, for benchmarks that break TTFT
                    # down per request.
                    kv, lane, prefill = chunk.timing
                    line = (
                        f": timing kv_wait_s={kv:.4f} lane_wait_s={lane:.4f} "
                        f"prefill_s={prefill:.4f} recv_at={received:.4f}"
                    )
                    a = chunk.arrival
                    if a is not None:
                        # The engine's KV on arrival, in blocks (engine.ArrivalKV).
                        line += (
                            f" free_blocks={a.free} need_blocks={a.need} held_blocks={a.held}"
                            f" ahead={a.ahead} ahead_blocks={a.ahead_need}"
                        )
                    out += (line + "\n\n").encode()
                for tid in chunk.token_ids:
                    produced += 1
                    done = "length" if produced == job.max_tokens else None
                    out += _sse(shape.piece(self.tokenizer.decode([tid]), done))
                await resp.write(bytes(out))
                last = chunk
        if include_usage:
            cached = last.cached_tokens if last else 0
            await resp.write(_sse(shape.usage(_usage(len(job.tokens.ids), produced, cached))))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()

    async def _models(self, request: web.Request) -> web.Response:
        s = self.settings.engine
        model = {
            "id": s.model,
            "object": "model",
            "created": int(self.engine.stats.created),
            "owned_by": "vllm",
            "root": s.model,
            "parent": None,
            "max_model_len": s.max_model_len,
        }
        body = {"object": "list", "data": [model]}
        return web.json_response(body, headers=self._headers(), dumps=_dumps)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(headers=self._headers())

    async def _metrics(self, request: web.Request) -> web.Response:
        s = self.settings.engine
        config = {
            "block_size": str(s.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "num_gpu_blocks": str(s.num_gpu_blocks),
            "num_cpu_blocks": str(s.num_cpu_blocks) if s.num_cpu_blocks else "None",
            "prefix_caching_hash_algo": "sha256",
        }
        text = render(self.engine.stats, self.engine.gauges(), s.model, config)
        return web.Response(
            text=text, content_type="text/plain", charset="utf-8", headers=self._headers()
        )

    async def _speed(self, request: web.Request) -> web.Response:
        return web.json_response({"relative_speed": self.engine.relative_speed})

    async def _steps(self, request: web.Request) -> web.Response:
        """The prefill lane's clock so far (metrics.py `EngineStats.steps`): how much slower
        than scheduled the steps really ran (a benchmark's machine starving the simulator)."""
        st = self.engine.stats
        body = {
            "steps": st.steps,
            "tokens": st.step_tokens,
            "scheduled_s": st.step_scheduled_s,
            "wall_s": st.step_wall_s,
        }
        return web.json_response(body, headers=self._headers())

    async def _set_speed(self, request: web.Request) -> web.Response:
        try:
            body = msgspec.json.decode(await request.read(), type=_Speed)
        except msgspec.DecodeError as exc:
            return self._error(400, str(exc), "BadRequestError")
        self.engine.relative_speed = body.relative_speed
        return await self._speed(request)

    async def _reset(self, request: web.Request) -> web.Response:
        self.engine.reset_prefix_cache()
        return web.Response(headers=self._headers())

    async def _restart(self, request: web.Request) -> web.Response:
        """A restart as a picker sees one, without the fleet's other servers going too (one
        process serves them all): the cache emptied and a new process start time."""
        self.engine.reset_prefix_cache()
        self.engine.stats.created = time.time()
        return web.Response(headers=self._headers())

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = {k.lower(): v for k, v in request.headers.items()}
        # /tokenize takes either shape; parse it as the API it resembles.
        path = "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"
        try:
            req = parse_request(path, headers, body, self._parse)
        except BadRequest as exc:
            return self._error(400, exc.message, "BadRequestError")
        ids = self.tokenizer.prompt_tokens(req.prompt).ids if req.prompt else ()
        s = self.settings.engine
        out = {"count": len(ids), "max_model_len": s.max_model_len, "tokens": list(ids)}
        return web.json_response(out, headers=self._headers(), dumps=_dumps)

    async def _cache(self, request: web.Request) -> web.Response:
        """The cache as it really is: every cached block per medium with its wire hash (as
        KV events carry it), parent, extproc precise `key`, token ids and extra keys."""
        hash_bytes = bool(self.settings.kv_events and self.settings.kv_events.hash_bytes)

        def wire(h: bytes | None) -> int | str | None:
            if h is None:
                return None
            w = wire_hash(h, hash_bytes)
            return w.hex() if isinstance(w, bytes) else w

        blocks = [
            {
                "medium": medium,
                "hash": wire(info.hash),
                "parent": wire(info.parent),
                "key": info.key,
                "token_ids": list(info.token_ids),
                "extra_keys": list(info.extra_keys) if info.extra_keys else None,
                "copies": copies,
                "refs": refs,
            }
            for medium, entries in self.engine.cache.snapshot().items()
            for info, copies, refs in entries
        ]
        s = self.settings.engine
        body = {
            "server": self.name,
            "model": s.model,
            "block_size": s.block_size,
            "num_gpu_blocks": s.num_gpu_blocks,
            "num_cpu_blocks": s.num_cpu_blocks,
            "kv_cache_usage": self.engine.cache.usage,
            "blocks": blocks,
            "encoder": self.engine.encoder.hashes(),
        }
        return web.json_response(body, headers=self._headers(), dumps=_dumps)


class _Shape:
    """OpenAI response bodies of one request, as vLLM 0.32 writes them."""

    def __init__(self, rid: str, created: int, model: str, chat: bool) -> None:
        self.rid, self.created, self.model, self.chat = rid, created, model, chat

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, usage: dict[str, Any]) -> dict[str, Any]:
        if self.chat:
            message: dict[str, Any] = {
                "role": "assistant", "content": text, "refusal": None,
                "annotations": None, "audio": None, "function_call": None,
                "tool_calls": [], "reasoning": None}  # fmt: skip
            choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice |= {"finish_reason": "length", "stop_reason": None, "token_ids": None}
        body = self._head("chat.completion" if self.chat else "text_completion")
        body |= {"choices": [choice], "service_tier": None, "system_fingerprint": FINGERPRINT,
                 "usage": usage, "kv_transfer_params": None}  # fmt: skip
        return body

    def delta(self, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = None
        return self._head("chat.completion.chunk") | {"choices": [choice]}

    def piece(self, text: str, finish: str | None) -> dict[str, Any]:
        if self.chat:
            return self.delta({"content": text}, finish)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                  "stop_reason": None}  # fmt: skip
        return self._head("text_completion") | {"choices": [choice]}

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._head(obj) | {"choices": [], "usage": usage}


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    # vLLM fills prompt_tokens_details only with --enable-prompt-tokens-details; we always
    # do, so benchmarks can read the hit per request.
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


@contextlib.asynccontextmanager
async def _background(coro: Any) -> AsyncIterator[None]:
    """Runs `coro` for the life of the context; cancelled (and awaited) on exit."""
    task = asyncio.ensure_future(coro)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
