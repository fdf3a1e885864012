"""A simulated server's KV-cache events over ZMQ, in vLLM 0.32's wire format (FACTS 6).

PUB messages are 3 frames: topic, 8-byte big-endian sequence (from 0), msgpack payload
`[ts, [events...], data_parallel_rank]`. Events are maps with a "type" key (vLLM 0.32) or
tagged positional arrays (older vLLM, `event_format="array"`). A ROUTER replay socket
answers a start sequence with the buffered `(topic, seq, payload)` messages, then seq -1
and an empty payload.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import zmq
import zmq.asyncio
from msgspec import msgpack

from extproc.sim.blocks import wire_hash
from extproc.sim.cache import CacheEvent, Cleared, Removed, Stored

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_KIND = "full_attention"


class KVEventsSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where and how one server publishes.

    - `endpoint`: ZMQ address of the PUB socket; bound when `bind` (a port of `*` picks a
      free one), else connected (to a subscriber that binds, as vLLM does without `*`).
    - `replay_endpoint`: ROUTER address to bind (None: no replay).
    - `topic`: first frame of every message (vLLM's default is ""); None lets the server
      pick llm-d's convention `kv@<ip:port>@<model>`.
    - `hash_bytes` (False): block hashes as 32 raw bytes instead of 64-bit unsigned ints
      (vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
    - `event_format` ("map"): "map" (vLLM 0.32) or "array" (tagged positional arrays).
    - `buffer_steps` (10000): batches kept for replay. `hwm` (100000): PUB send HWM.
    """

    endpoint: str
    bind: bool = True
    replay_endpoint: str | None = None
    topic: str | None = None
    hash_bytes: bool = False
    event_format: Literal["map", "array"] = "map"
    buffer_steps: int = 10000
    hwm: int = 100000


def encode_event(event: CacheEvent, block_size: int, hash_bytes: bool, event_format: str) -> Any:
    """One event as vLLM serializes it (before msgpack)."""
    if isinstance(event, Stored):
        first = event.blocks[0]
        fields: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": [wire_hash(b.hash, hash_bytes) for b in event.blocks],
            "parent_block_hash": (
                wire_hash(first.parent, hash_bytes) if first.parent is not None else None
            ),
            "token_ids": [t for b in event.blocks for t in b.token_ids],
            "block_size": block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": None,
            "extra_keys": [list(b.extra_keys) if b.extra_keys else None for b in event.blocks],
            "group_idx": 0,
            "kv_cache_spec_kind": _KIND,
        }
    elif isinstance(event, Removed):
        fields = {
            "type": "BlockRemoved",
            "block_hashes": [wire_hash(event.hash, hash_bytes)],
            "medium": event.medium,
            "group_idx": 0,
        }
    elif isinstance(event, Cleared):
        fields = {"type": "AllBlocksCleared"}
    else:
        raise TypeError(f"not a cache event: {event!r}")
    return fields if event_format == "map" else list(fields.values())


def encode_batch(
    events: Sequence[CacheEvent],
    block_size: int,
    hash_bytes: bool = False,
    event_format: str = "map",
    ts: float | None = None,
) -> bytes:
    """The msgpack payload of one batch: `[ts, events, data_parallel_rank=0]`."""
    encoded = [encode_event(e, block_size, hash_bytes, event_format) for e in events]
    return msgpack.encode([time.time() if ts is None else ts, encoded, 0])


class KVEventPublisher:
    """Publishes batches of one server's cache events and serves replay.

    Lifecycle: `start()` opens the sockets (raises `OSError` when an address is taken),
    `run()` serves replay until cancelled, `close()` closes everything. `publish` never
    blocks: past the HWM the PUB socket drops, as vLLM's does."""

    def __init__(self, settings: KVEventsSettings, block_size: int) -> None:
        self.settings = settings
        self.block_size = block_size
        self.url: str | None = None
        self.replay_url: str | None = None
        self.next_seq = 0
        self.dropped = 0
        self._topic = (settings.topic or "").encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=settings.buffer_steps)
        self._ctx: zmq.Context[Any] | None = None
        self._pub: zmq.Socket[Any] | None = None
        self._replay: zmq.asyncio.Socket | None = None

    def start(self) -> None:
        self._ctx = zmq.Context()
        try:
            pub = self._pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, self.settings.hwm)
            if self.settings.bind:
                pub.bind(self.settings.endpoint)
                self.url = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(self.settings.endpoint)
                self.url = self.settings.endpoint
            if self.settings.replay_endpoint:
                actx = zmq.asyncio.Context.shadow(self._ctx.underlying)
                replay = self._replay = actx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.settings.replay_endpoint)
                self.replay_url = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self.close()
            raise OSError(f"kv events: cannot open {self.settings.endpoint}: {exc}") from exc

    def publish(self, events: Sequence[CacheEvent]) -> None:
        if not events or self._pub is None:
            return
        payload = encode_batch(
            events, self.block_size, self.settings.hash_bytes, self.settings.event_format
        )
        seq = self.next_seq
        self.next_seq += 1
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1

    async def run(self) -> None:
        """Answers replay requests until cancelled (returns at once without replay)."""
        if self._replay is None:
            return
        while True:
            frames = await self._replay.recv_multipart()
            try:
                await self._answer(frames)
            except zmq.ZMQError as exc:
                log.warning("kv events replay: %s", exc)

    async def _answer(self, frames: list[bytes]) -> None:
        assert self._replay is not None
        # REQ and DEALER-with-delimiter clients send [id, b"", start]; bare DEALERs [id, start].
        if len(frames) == 3 and not frames[1]:
            head = [frames[0], b""]
        elif len(frames) == 2:
            head = [frames[0]]
        else:
            return
        start = int.from_bytes(frames[-1], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                await self._replay.send_multipart(
                    [*head, self._topic, seq.to_bytes(8, "big"), payload]
                )
        await self._replay.send_multipart([*head, self._topic, END_SEQ, b""])

    def close(self) -> None:
        for sock in (self._replay, self._pub):
            if sock is not None:
                sock.close(linger=0)
        self._replay = self._pub = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
