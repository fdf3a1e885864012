"""The live-session record shared by picker replicas through Redis.

Behind one gateway, each replica places about a third of the turns; with a record of its own
each would see a third of the sessions and bound new ones by that, and a session whose turns
alternate between replicas would look new at each (session_chains.py). Replicas therefore publish
their placements and apply each other's: every replica's record converges on the same
sessions per server, and any replica finds a session's tail.

The hot path never awaits Redis: a placement is applied locally at once and queued; one
background loop appends what is queued to a stream as soon as it can, another waits on the
stream (a blocking read) and applies the peers' placements as they arrive, a few ms after
they were made (a session's next turn comes after its answer, plus a tool or a person: on
a shared index its lookup must find both the blocks and the session of the last turn, so a
periodic exchange of tens of ms would not do). Layout: one stream `<ns>`, an entry per
batch (`d`: msgpack `[process id, [[plugin, previous tail, endpoint, tail, first-turn
blocks, first-turn class], ...]]`; the length is 0 and the class "" when not known, and
both are absent from older replicas; the class, a few bytes, is what lets
`uncontinuedPrior` count a continuation for its class wherever it was placed,
scheduling/plugins/session_classes.py),
trimmed to about `max_entries` entries, so Redis memory is bounded whatever the load; a
replica that starts (or comes back) reads the entries of the last session window.

Redis down: each replica keeps its own record (its own placements only), says so once in a
log line, shows `extproc_shared_sessions_degraded` 1 and counts failed exchanges; it
reconnects by itself and catches up with what the stream still holds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import msgpack
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from extproc.redis_broadcast import by_order
from extproc.redis_client import redis_from_url
from extproc.redis_loop import Outage, close, command
from extproc.scheduling.plugins.session_classes import UNKNOWN_CLASS
from extproc.scheduling.plugins.sessions import BoundedSessionsFilter, LiveSessions, Touch
from extproc.throttle import Throttle

log = logging.getLogger(__name__)

# The longest first turn a placement may claim, in blocks (2**20 blocks of 16 tokens: 16M
# tokens, past any context window); a forged length beyond is refused.
_MAX_FIRST_BLOCKS = 1 << 20
# The longest class name a placement may carry (session_class's are at most 24 bytes).
_MAX_CLASS_CHARS = 64


@dataclass(slots=True)
class SharedSessionsStats:
    """Counters since start: `exchanges` and `errors` with Redis, placements `published`
    (this replica's) and `applied` (the peers'), placements `dropped` (queue full while
    Redis failed), `bad_entries` skipped (undecodable)."""

    exchanges: int = 0
    errors: int = 0
    published: int = 0
    applied: int = 0
    dropped: int = 0
    bad_entries: int = 0


class SharedSessions:
    """Shares the records of `sessions` (plugin name -> record) with the other replicas.
    `run()` is the exchange loop (until cancelled); `aclose()` closes an owned client."""

    def __init__(
        self,
        client: Redis | RedisCluster,
        sessions: Mapping[str, LiveSessions],
        *,
        process_id: str,
        window_s: float,
        key: str = "extproc:sessions",
        block_s: float = 1.0,
        timeout_s: float = 0.5,
        max_entries: int = 20_000,
        max_pending: int = 50_000,
        owns_client: bool = False,
    ) -> None:
        self._client = client
        self._sessions = dict(sessions)
        self._id = process_id
        self._window_ms = int(window_s * 1000)
        self._key = key
        self._block_ms = int(block_s * 1000)
        self._timeout = timeout_s
        self._max_entries = max_entries
        self._max_pending = max_pending
        self._owns_client = owns_client
        self._pending: list[tuple[str, Touch]] = []
        self._cursor: str | None = None  # the last stream id read; None: not started yet
        self._outage = Outage(
            log,
            failed_msg="shared sessions: Redis exchange failed (%r); placing new sessions on "
            "this replica's own record until it is back",
            healed_msg="shared sessions: Redis back after %d failed exchanges",
        )
        self._now_ms = 0  # Redis's clock, as last seen
        self._wake = asyncio.Event()
        self._abandoned: set[asyncio.Task[Any]] = set()  # Redis calls left to end (stop)
        self.stats = SharedSessionsStats()
        self._throttle = Throttle()  # a stray writer can fill the stream: one line per 10 s
        for name, record in self._sessions.items():
            record.on_touch = lambda touch, name=name: self._queue(name, touch)

    @classmethod
    def from_url(
        cls, url: str, sessions: Mapping[str, LiveSessions], *, cluster: bool = False, **kw: Any
    ) -> SharedSessions:
        client = redis_from_url(url, cluster=cluster, connect_timeout_s=1.0, timeout_s=2.0)
        return cls(client, sessions, owns_client=True, **kw)

    @staticmethod
    def records(plugins: Iterable[object]) -> dict[str, LiveSessions]:
        """The session records of a scheduler's plugins, named by the filters' order among
        them (`by_order`, as shared growth names the same records)."""
        return {name: p.sessions for name, p in by_order(plugins, BoundedSessionsFilter).items()}

    @property
    def is_degraded(self) -> bool:
        """The last exchange failed: the record holds this replica's placements only."""
        return self._outage.degraded

    @property
    def live(self) -> int:
        """Live sessions in the shared records (counted by each replica alike)."""
        return sum(len(r) for r in self._sessions.values())

    def _queue(self, name: str, touch: Touch) -> None:
        if len(self._pending) >= self._max_pending:
            self.stats.dropped += 1
            return
        self._pending.append((name, touch))
        self._wake.set()

    async def run(self) -> None:
        """Publishes placements as they come and reads the peers' as they arrive (a
        blocking read): a session's next turn may come within a few hundred ms."""
        await asyncio.gather(self._publish_loop(), self._read_loop())

    async def _publish_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._pending:
                continue
            batch, self._pending = self._pending, []
            blob = msgpack.encode(
                [self._id, [(n, list(p), e, list(t), f, c) for n, (p, e, t, f, c) in batch]]
            )
            add = self._client.xadd(
                self._key, {"d": blob}, maxlen=self._max_entries, approximate=True
            )
            try:
                await command(add, self._timeout, self._abandoned)
            except (RedisError, OSError, TimeoutError) as exc:
                # Sent again with the next batch (late: peers see it a little older).
                queued = batch + self._pending
                self.stats.dropped += max(0, len(queued) - self._max_pending)
                self._pending = queued[-self._max_pending :]
                self.stats.errors += 1
                await asyncio.sleep(self._outage.failed(exc, "publish"))
                self._wake.set()
                continue
            self.stats.published += len(batch)
            self._outage.healed("publish")

    async def _read_loop(self) -> None:
        client = self._client
        while True:
            try:
                if self._cursor is None:
                    # Start where the session window starts, by Redis's clock (stream ids
                    # are its ms), so a replica that starts late knows the live sessions.
                    sec, usec = await command(client.time(), self._timeout, self._abandoned)
                    self._now_ms = sec * 1000 + usec // 1000
                    self._cursor = f"{max(0, self._now_ms - self._window_ms)}-0"
                xread = client.xread({self._key: self._cursor}, count=1000, block=self._block_ms)
                read = await command(xread, self._block_ms / 1000 + self._timeout, self._abandoned)
            except (RedisError, OSError, TimeoutError) as exc:
                self.stats.errors += 1
                await asyncio.sleep(self._outage.failed(exc, "read"))
                continue
            self._apply(read)
            self.stats.exchanges += 1
            self._outage.healed("read")

    def _apply(self, read: Any) -> None:
        if not read:
            return
        # RESP2 answers [[key, entries]], RESP3 {key: [entries]}.
        entries = next(iter(read.values()))[0] if isinstance(read, dict) else read[0][1]
        if not entries:
            return
        # Ages are measured on Redis's clock: the newest id seen stands for "now".
        newest = self._now_ms = max(self._now_ms, _ms(entries[-1][0]))
        for entry_id, fields in entries:
            self._cursor = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            raw = fields.get(b"d", fields.get("d")) if isinstance(fields, dict) else None
            try:
                sender, touches = msgpack.decode(raw) if raw is not None else ("", [])
                if sender == self._id:
                    continue
                age_s = max(0, newest - _ms(entry_id)) / 1000.0
                for name, prev, endpoint, tail, *rest in touches:
                    record = self._sessions.get(name)
                    if record is not None:
                        first, cls = _first(rest), _class(rest)
                        record.apply((tuple(prev), str(endpoint), tuple(tail), first, cls), age_s)
                        self.stats.applied += 1
            except (ValueError, TypeError, msgspec.DecodeError) as exc:
                # Another version or a stray writer on our key: skip, never fail; say so.
                self.stats.bad_entries += 1
                self._throttle.warn(
                    log, "bad entry", "shared sessions: a stream entry skipped (%r)", exc
                )

    async def aclose(self) -> None:
        if self._owns_client:
            await close(self._client, "shared sessions", self._abandoned)


def _first(rest: list[Any]) -> int:
    """A placement's first-turn length (blocks): 0 (not known) from a replica that does not
    send it; a forged one is refused (the entry is skipped, counted)."""
    if not rest:
        return 0
    first = rest[0]
    if type(first) is not int or not 0 <= first <= _MAX_FIRST_BLOCKS:
        raise ValueError("first-turn length")
    return first


def _class(rest: list[Any]) -> str:
    """A placement's first-turn class: "" (not known) from a replica that does not send it;
    a forged one (not a short string) is refused (the entry is skipped, counted)."""
    if len(rest) < 2:
        return UNKNOWN_CLASS
    cls = rest[1]
    if type(cls) is not str or len(cls) > _MAX_CLASS_CHARS:
        raise ValueError("first-turn class")
    return cls


def _ms(entry_id: Any) -> int:
    s = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    return int(s.partition("-")[0])
