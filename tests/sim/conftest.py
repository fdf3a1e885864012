"""Simulated servers started in-process on free ports, and a ZMQ subscriber for their
KV events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import msgpack
import msgspec
import pytest
import zmq
import zmq.asyncio

from extproc.sim.engine import EngineSettings
from extproc.sim.kvevents import KVEventsSettings
from extproc.sim.server import ServerSettings, SimServer
from extproc.sim.timing import TimingSettings
from extproc.sim.tokens import SimTokenizer

FAST = TimingSettings(speed=50.0)


@pytest.fixture(scope="session")
def tokenizer() -> SimTokenizer:
    return SimTokenizer()


StartSim = Callable[..., AbstractAsyncContextManager[SimServer]]


@pytest.fixture
def start_sim(tokenizer: SimTokenizer) -> StartSim:
    """`async with start_sim(num_gpu_blocks=8, kv=dict(hash_bytes=True)) as srv:` — engine
    fields as keywords, `kv` for KVEventsSettings fields, `events=False` for none."""

    @asynccontextmanager
    async def start(
        kv: dict[str, Any] | None = None,
        events: bool = True,
        chat_max_tokens: int = 256,
        **engine: Any,
    ) -> AsyncIterator[SimServer]:
        engine.setdefault("timing", FAST)
        kv_events = None
        if events:
            fields = {"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}
            kv_events = KVEventsSettings(**(fields | (kv or {})))
        settings = ServerSettings(
            engine=EngineSettings(**engine), kv_events=kv_events, chat_max_tokens=chat_max_tokens
        )
        async with SimServer(settings, tokenizer) as srv:
            yield srv

    return start


class Subscriber:
    """A real SUB socket on a server's PUB endpoint; `batches()` decodes what arrived."""

    def __init__(self, url: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(url)

    async def frames(self, n: int, timeout_s: float = 5.0) -> list[list[bytes]]:
        out = []
        async with asyncio.timeout(timeout_s):
            for _ in range(n):
                out.append(await self.sock.recv_multipart())
        return out

    async def drain(self, idle_s: float = 0.2) -> list[list[bytes]]:
        """Every message until none arrives for `idle_s`."""
        out = []
        while await self.sock.poll(int(idle_s * 1000)):
            out.append(await self.sock.recv_multipart())
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
async def subscribe() -> AsyncIterator[Callable[[str], Any]]:
    subs: list[Subscriber] = []

    async def connect(url: str) -> Subscriber:
        sub = Subscriber(url)
        subs.append(sub)
        await asyncio.sleep(0.2)  # ZMQ slow joiner: let the subscription reach the PUB
        return sub

    yield connect
    for sub in subs:
        sub.close()


def decode(frames: list[bytes]) -> tuple[bytes, int, list[Any]]:
    """(topic, seq, [ts, events, dp_rank]) of one PUB message."""
    topic, seq, payload = frames
    return topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload, raw=False)


def events_of(messages: list[list[bytes]]) -> list[dict[str, Any]]:
    return [ev for m in messages for ev in decode(m)[2][1]]


def replace(settings: Any, **changes: Any) -> Any:
    return msgspec.structs.replace(settings, **changes)
