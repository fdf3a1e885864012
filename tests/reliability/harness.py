"""Pieces the fault tests share: an in-process picker, a request driven the way Envoy drives
it (headers, body, end of stream) with its decision latency, a load loop that counts
outcomes, and a TCP proxy that delays every byte (a slow network to Redis)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import orjson

from extproc.config import decode_settings
from extproc.endpoints import parse_endpoints
from extproc.server.app import App
from extproc.stack import free_port
from extproc.testing import ExtProcClient, body_chunks, destination, post, request_headers

SYSTEM = "You are a meticulous assistant who answers in short sentences. " * 40


def chat(conversation: int, turn: int) -> bytes:
    """Turn `turn` of a conversation: the system prompt, then every earlier turn, so each
    turn extends the previous one's prefix (what affinity is for)."""
    messages = [{"role": "system", "content": f"Conversation {conversation}. " + SYSTEM}]
    for t in range(turn):
        messages.append({"role": "user", "content": f"Question {t} of {conversation}?"})
        messages.append({"role": "assistant", "content": f"Answer {t}. " * 12})
    messages.append({"role": "user", "content": f"Question {turn} of {conversation}?"})
    return orjson.dumps({"model": "m", "messages": messages})


def fake_endpoints(n: int) -> list[str]:
    """Loopback addresses nobody listens on: routing only, the picker never contacts them
    (scraping off)."""
    return [f"127.0.0.1:{free_port()}" for _ in range(n)]


@contextlib.asynccontextmanager
async def picker(endpoints: list[str], **sections: Any) -> AsyncIterator[App]:
    doc = {
        "endpoints": endpoints,
        "server": {
            "host": "127.0.0.1",
            "port": 0,
            "health_port": 0,
            "admin_port": None,
            "plaintext": True,
        },
        "state": {"scrape": None},
        **sections,
    }
    async with App(decode_settings(doc), parse_endpoints(",".join(endpoints))) as app:
        yield app


async def route(client: ExtProcClient, body: bytes) -> tuple[str, float]:
    """(destination, seconds from the first message to the decision)."""
    start = time.perf_counter()
    out = await client.exchange([request_headers(post("/v1/chat/completions")), *body_chunks(body)])
    elapsed = time.perf_counter() - start
    dest = destination(out[0])
    if dest is None:
        raise AssertionError(f"no destination: {out[0]}")
    return dest, elapsed


@dataclass
class Load:
    """`workers` concurrent request loops against a picker until `stop()`; every request is
    a new turn of one of `conversations`. Counts outcomes and keeps decision latencies."""

    target: str
    workers: int = 4
    conversations: int = 40
    ok: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task] = field(default_factory=list)

    async def _worker(self, w: int) -> None:
        n = w
        async with ExtProcClient(self.target) as client:
            while not self._stop.is_set():
                conv, turn = n % self.conversations, (n // self.conversations) % 6
                n += self.workers
                try:
                    _, seconds = await route(client, chat(conv, turn))
                except (AssertionError, grpc.aio.AioRpcError) as exc:
                    self.failed += 1
                    self.errors.append(repr(exc)[:200])
                else:
                    self.ok += 1
                    self.latencies_s.append(seconds)
                await asyncio.sleep(0.005)

    def start(self) -> Load:
        self._tasks = [asyncio.create_task(self._worker(w)) for w in range(self.workers)]
        return self

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class DelayProxy:
    """Forwards TCP from a local port to `upstream_port`, every chunk delayed `delay_s` each
    way (order kept): a slow Redis without touching Redis."""

    def __init__(self, upstream_port: int, delay_s: float) -> None:
        self.upstream_port = upstream_port
        self.delay_s = delay_s
        self.port = 0
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task] = set()

    async def __aenter__(self) -> DelayProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        up_w: asyncio.StreamWriter | None = None
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer))
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            self._conns.discard(task)
            for w in (writer, up_w):
                if w is not None:
                    w.close()
                    with contextlib.suppress(OSError, asyncio.CancelledError):
                        await w.wait_closed()

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, chunk = await queue.get()
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                if not chunk:
                    dst.close()
                    return
                dst.write(chunk)
                await dst.drain()

        sender = asyncio.create_task(deliver())
        try:
            while True:
                chunk = await src.read(65536)
                await queue.put((time.monotonic() + self.delay_s, chunk))
                if not chunk:
                    break
            await sender
        finally:
            sender.cancel()


async def eventually(check: Callable[[], Any], timeout_s: float, step_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(step_s)
    return False
