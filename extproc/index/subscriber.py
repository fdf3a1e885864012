"""ZMQ side of precise mode: SUB sockets for vLLM KV events, and replay requests.

One SUB socket per endpoint that it dials (`watch`), and/or one bound SUB socket that pods
connect to (`bind`), whose messages are attributed to endpoints by topic
(`kv@<ip[:port]>@<model>`, vLLM's convention). Messages go to one `EventIngest` per endpoint.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from extproc.index.base import KVIndex
from extproc.index.curve import CurveKeys
from extproc.index.kvevents import EventIngest, IngestStats
from extproc.throttle import Throttle

log = logging.getLogger(__name__)

_REPLAY_END = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one endpoint publishes: `url` to dial (e.g. `tcp://10.0.0.1:5557`), optional
    ROUTER `replay_url` (e.g. `tcp://10.0.0.1:5558`), and `model` ("" = the subscriber's)."""

    endpoint: str
    url: str
    replay_url: str | None = None
    model: str = ""


def endpoint_from_topic(topic: bytes, default_port: int = 8000) -> tuple[str, str] | None:
    """`kv@<ip[:port]>@<model>` -> (endpoint address, model); None for other topics."""
    parts = topic.decode(errors="replace").split("@", 2)
    if len(parts) < 2 or parts[0] != "kv" or not parts[1]:
        return None
    host = parts[1]
    if ":" not in host.rsplit("]", 1)[-1]:
        host = f"{host}:{default_port}"
    return host, parts[2] if len(parts) == 3 else ""


def same_host(endpoint: str, peer: str) -> bool:
    """Does `ip:port` (or `[v6]:port`) name the host at IP address `peer`?"""
    host = endpoint.rpartition(":")[0].strip("[]")
    try:
        a, b = ipaddress.ip_address(host), ipaddress.ip_address(peer)
    except ValueError:
        return False
    if isinstance(b, ipaddress.IPv6Address) and b.ipv4_mapped is not None:
        b = b.ipv4_mapped
    return a == b


class KVEventSubscriber:
    """Feeds the index from vLLM KV events until cancelled (`run`).

    `model`: the model name that seeds chains (must equal the request side's). `bind`: an
    address to bind one SUB socket on (e.g. `tcp://*:5557`) for pods that connect.
    `topic_endpoint` maps a bound-socket topic to (endpoint, model), default
    `endpoint_from_topic`. Malformed frames are counted in `stats.malformed` and skipped.

    Trust (bound socket): anyone who reaches it can publish, and the topic names the endpoint,
    so a message counts only if `is_member(endpoint)` (the pool, from discovery) and it came
    from that endpoint's own IP (the TCP peer address); `curve` additionally requires CURVE
    encryption with a publisher key on its allow-list. Refused messages count in
    `stats.rejected`. Dialed sockets need none of this: they connect to pool addresses only.
    `on_message(endpoint)` is called for each message attributed to an endpoint (O(1)).
    """

    def __init__(
        self,
        index: KVIndex,
        *,
        model: str,
        bind: str | None = None,
        topic_endpoint: Callable[[bytes], tuple[str, str] | None] = endpoint_from_topic,
        block_size: int = 16,
        replay_port: int | None = None,
        replay_timeout_s: float = 1.0,
        max_messages_per_pass: int = 256,
        is_member: Callable[[str], bool] | None = None,
        curve: CurveKeys | None = None,
        on_message: Callable[[str], None] | None = None,
        on_cleared: Callable[[str], None] | None = None,
    ) -> None:
        self._index = index
        # An endpoint's engine emptied its prefix cache (AllBlocksCleared): `EventIngest`.
        self._on_cleared = on_cleared
        # Each message attributed to an endpoint, before it is applied (silence.py: a
        # publisher that is heard at all is alive, whatever its message holds).
        self._on_message = on_message
        self._model = model
        self._bind = bind
        self._topic_endpoint = topic_endpoint
        self._block_size = block_size
        # Bound socket: endpoints attributed by topic are replayed from <their host>:port.
        self._replay_port = replay_port
        self._replay_timeout_s = replay_timeout_s
        self._max_per_pass = max_messages_per_pass
        self._is_member = is_member
        self._curve = curve
        self._auth: Any = None
        self._throttle = Throttle(every_s=10.0)
        self._sources: dict[str, EventSource] = {}
        self._ingests: dict[str, EventIngest] = {}
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._dialed: dict[str, zmq.Socket[bytes]] = {}
        # Each dialed socket's connection events (`_watched`), and the publishers whose
        # connection is lost now, since when (said once each way; before, a publisher that
        # went away showed only as silence, which an idle engine's is too).
        self._monitors: dict[str, zmq.Socket[bytes]] = {}
        self._down: dict[str, float] = {}
        self._bound: zmq.Socket[bytes] | None = None
        self._wake = asyncio.Event()
        self.stats = IngestStats()
        self.bound_url: str | None = None  # the bound socket's real address (port 0 resolved)

    def watch(self, source: EventSource) -> None:
        """Subscribe to an endpoint (takes effect on the next pass of `run`)."""
        self._sources[source.endpoint] = source
        self._wake.set()

    def unwatch(self, endpoint: str) -> None:
        """Stop listening to an endpoint; its index entries stay (see `remove_endpoint`)."""
        self._sources.pop(endpoint, None)
        self._wake.set()

    async def invalidate(self, endpoint: str) -> None:
        """Forget what `endpoint` holds (its engine restarted or is gone)."""
        ingest = self._ingests.get(endpoint)
        if ingest is not None:
            await ingest.invalidate()
        else:
            await self._index.remove_endpoint(endpoint)

    def ingest(self, endpoint: str) -> EventIngest | None:
        return self._ingests.get(endpoint)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._ctx = zmq.Context()
        try:
            if self._bind is not None:
                self._bound = self._socket(loop)
                if self._curve is not None:
                    self._auth = self._curve.serve(self._ctx, self._bound)
                self._bound.bind(self._bind)
                self.bound_url = self._bound.getsockopt_string(zmq.LAST_ENDPOINT)
            while True:
                self._sync_sockets(loop)
                if not await self._drain():
                    self._wake.clear()
                    # The ZMQ FD is edge-triggered: look once more before sleeping on it.
                    if not self._readable():
                        try:
                            async with asyncio.timeout(0.2):
                                await self._wake.wait()
                        except TimeoutError:
                            pass
                await asyncio.sleep(0)  # lookups share this loop: never hog it
        finally:
            for endpoint in list(self._monitors):
                self._unmonitor(loop, endpoint)
            for sock in [*self._dialed.values(), *([self._bound] if self._bound else [])]:
                self._close(loop, sock)
            self._dialed.clear()
            self._bound = None
            if self._auth is not None:
                self._auth.stop()
                self._auth = None
            self._ctx.destroy(linger=0)
            self._ctx = None

    def _socket(self, loop: asyncio.AbstractEventLoop) -> zmq.Socket[bytes]:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        loop.add_reader(_fd(sock), self._wake.set)
        return sock

    def _close(self, loop: asyncio.AbstractEventLoop, sock: zmq.Socket[bytes]) -> None:
        loop.remove_reader(_fd(sock))
        sock.close(linger=0)

    def _unmonitor(self, loop: asyncio.AbstractEventLoop, endpoint: str) -> None:
        sock = self._dialed.get(endpoint)
        if sock is not None:
            sock.disable_monitor()
        mon = self._monitors.pop(endpoint, None)
        if mon is not None:
            self._close(loop, mon)
        if self._down.pop(endpoint, None) is not None:
            self.stats.publishers_down = len(self._down)

    def _sync_sockets(self, loop: asyncio.AbstractEventLoop) -> None:
        for endpoint in [ep for ep in self._dialed if ep not in self._sources]:
            self._unmonitor(loop, endpoint)
            self._close(loop, self._dialed.pop(endpoint))
        for endpoint, source in self._sources.items():
            if endpoint not in self._dialed:
                sock = self._socket(loop)
                events = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                mon = sock.get_monitor_socket(events)
                loop.add_reader(_fd(mon), self._wake.set)
                self._monitors[endpoint] = mon
                sock.connect(source.url)
                self._dialed[endpoint] = sock

    def _readable(self) -> bool:
        socks = [
            *self._dialed.values(),
            *self._monitors.values(),
            *([self._bound] if self._bound else []),
        ]
        return any(cast(int, s.getsockopt(zmq.EVENTS)) & zmq.POLLIN for s in socks)

    def _watched(self) -> bool:
        """Reads the dialed sockets' connection events; True if any were read."""
        got = False
        for endpoint, mon in list(self._monitors.items()):
            while True:
                try:
                    event = recv_monitor_message(mon, zmq.NOBLOCK)
                except zmq.Again:
                    break
                got = True
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self._lost(endpoint)
                elif event["event"] == zmq.EVENT_CONNECTED:
                    self._back(endpoint)
        return got

    def _lost(self, endpoint: str) -> None:
        if endpoint in self._down:
            return
        self._down[endpoint] = time.monotonic()
        self.stats.disconnects += 1
        self.stats.publishers_down = len(self._down)
        log.warning(
            "kv events: publisher of %s disconnected; its cache changes are not seen until "
            "it reconnects (retried by itself)",
            endpoint,
        )

    def _back(self, endpoint: str) -> None:
        since = self._down.pop(endpoint, None)
        if since is None:
            return  # the first connection
        self.stats.publishers_down = len(self._down)
        log.info(
            "kv events: publisher of %s reconnected after %.1f s (batches sent meanwhile are "
            "replayed or the endpoint resynced at the sequence gap)",
            endpoint,
            time.monotonic() - since,
        )

    async def _drain(self) -> bool:
        """Up to `max_messages_per_pass` messages per socket; True if any were read."""
        got = self._watched()
        for endpoint, sock in list(self._dialed.items()):
            for _ in range(self._max_per_pass):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                got = True
                await self._dispatch_safely(frames, endpoint)
        if self._bound is not None:
            for _ in range(self._max_per_pass):
                try:
                    parts = self._bound.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                got = True
                # A string property of the frame (pyzmq types every property int | str).
                peer = cast(str, parts[0].get("Peer-Address")) if parts else None
                await self._dispatch_safely([p.bytes for p in parts], None, peer=peer)
        return got

    async def _dispatch_safely(
        self, frames: Sequence[bytes], endpoint: str | None, *, peer: str | None = None
    ) -> None:
        try:
            await self._dispatch(frames, endpoint, peer)
        except Exception:  # one bad message must never stop ingestion for every endpoint
            self.stats.malformed += 1
            # With its traceback (a message that raised is a bug to fix), but once per 10 s:
            # a publisher repeating it would otherwise write one per message.
            suppressed = self._throttle.allow("dispatch raised")
            if suppressed is not None:
                log.exception(
                    "kv events: message from %s skipped (%d more like it since the last line)",
                    endpoint or "bound socket",
                    suppressed,
                )

    async def _dispatch(
        self, frames: Sequence[bytes], endpoint: str | None, peer: str | None = None
    ) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._malformed("message is not [topic, 8-byte seq, payload]", endpoint or peer)
            return
        topic, seq, payload = frames
        model = ""
        if endpoint is None:
            found = self._topic_endpoint(topic)
            if found is None:
                self._malformed("topic names no endpoint", peer)
                return
            endpoint, model = found
            if not self._admits(endpoint, peer):
                return
        if self._on_message is not None:
            self._on_message(endpoint)
        ingest = self._ingests.get(endpoint)
        if ingest is None:
            source = self._sources.get(endpoint)
            replay = None
            if source is not None:
                model = source.model or model
                if source.replay_url:
                    url = source.replay_url
                    replay = lambda start: self._replay(url, start)  # noqa: E731
            elif self._replay_port is not None:
                host = endpoint.rpartition(":")[0]
                url = f"tcp://{host}:{self._replay_port}"
                replay = lambda start: self._replay(url, start)  # noqa: E731
            ingest = self._ingests[endpoint] = EventIngest(
                self._index,
                endpoint,
                model or self._model,
                stats=self.stats,
                block_size=self._block_size,
                replay=replay,
                throttle=self._throttle,
                on_cleared=self._on_cleared,
            )
        await ingest.handle(int.from_bytes(seq, "big"), payload)

    def _admits(self, endpoint: str, peer: str | None) -> bool:
        """A bound-socket message names its endpoint in the topic: believe it only for a pool
        member, and only from that member's own address."""
        reason = None
        if self._is_member is not None and not self._is_member(endpoint):
            reason = "topic names no pool endpoint"
        elif peer is not None and not same_host(endpoint, peer):
            reason = "publisher address is not the endpoint's"
        if reason is None:
            return True
        self.stats.rejected += 1
        self._throttle.warn(
            log,
            reason,
            "kv events: message refused (%s)",
            reason,
            extra={"endpoint": endpoint, "peer": peer},
        )
        return False

    def _malformed(self, reason: str, source: str | None) -> None:
        """A message skipped before it reaches an endpoint's ingest: counted in `malformed`,
        said at most once per reason per 10 s."""
        self.stats.malformed += 1
        self._throttle.warn(
            log, reason, "kv events: message skipped (%s)", reason, extra={"source": source}
        )

    async def _replay(self, url: str, start: int) -> list[tuple[int, bytes]] | None:
        """Ask a vLLM ROUTER replay socket for batches from `start` (FACTS 6)."""
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        loop = asyncio.get_running_loop()
        try:
            sock.connect(url)
            # vLLM's ROUTER expects REQ framing: an empty delimiter, then the start.
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = loop.time() + self._replay_timeout_s
            out: list[tuple[int, bytes]] = []
            while True:
                if not sock.poll(0):
                    if loop.time() > deadline:
                        return None
                    await asyncio.sleep(0.001)
                    continue
                frames = sock.recv_multipart()
                # Drop the REQ delimiter (and an empty topic, which is vLLM's default).
                while frames and not frames[0]:
                    frames = frames[1:]
                if len(frames) == 3:  # vLLM 0.32 includes the topic frame
                    frames = frames[1:]
                if len(frames) != 2 or len(frames[0]) != 8:
                    self._malformed("replay answer is not [8-byte seq, payload]", url)
                    return None
                if frames[0] == _REPLAY_END:
                    return out
                out.append((int.from_bytes(frames[0], "big"), frames[1]))
        finally:
            sock.close(linger=0)


def _fd(sock: zmq.Socket[bytes]) -> int:
    """The socket's edge-triggered notification FD (ZMQ_FD is an int option; pyzmq types
    every option's value as int | bytes)."""
    return cast(int, sock.getsockopt(zmq.FD))
