"""A Redis pub/sub channel between picker replicas, batched: what one replica queues reaches
every other one within about `interval_s` (shared request ends, shared observations).

The hot path only queues an item (bounded: past `max_pending` it is dropped and counted).
One loop publishes the queue every `interval_s`, one msgpack message `[process_id, items]`
per batch; another applies the peers' items as they arrive (never this replica's own).
Pub/sub keeps nothing in Redis, so its memory is bounded; a replica that is disconnected
misses what was said meanwhile. Redis failing: the batch is dropped (counted), the feature's
`Outage` says so once and shows degraded, the loops back off and reconnect by themselves. With
nothing to publish, a failed publish side is probed with PING, so the degraded flag falls
once Redis is back. With `timed`, each item reaches the peers as `[age_s, item]`: how long
it waited in this replica's queue before its batch was published (the peer can date what it
describes without comparing clocks across hosts). A peer's message that does not decode, or
an item `apply` rejects with ValueError/TypeError, is counted as malformed and skipped. What a
peer (or a stray publisher) can repeat at will, and a full backlog, is said in a rate-limited
warning (`Throttle`: one line per reason per 10 s, with how many were suppressed), never a
line per message.

`interval_s=0` publishes as soon as something is queued instead of on a clock: one publish
at a time, what is queued while one is under way goes out in the next (so a burst of items
in one event-loop pass is one message). For what a peer must see at once (the in-flight
push, endpoints/inflight_push.py); the cost is one PUBLISH per batch, not per interval.
With `with_sender`, `apply` gets `(sender, item)`: the sending replica's id as it named
itself (a peer's word, like the item).

With `retention` (retained.py), the channel also keeps each published item in a bounded
snapshot in Redis and reads it after each successful subscribe (on start and after every
reconnect), handing its entries to `apply` like pushed items: a replica that starts late, or
was cut off, learns the long-lived records its peers published meanwhile. A failed snapshot
write or read is said (rate-limited) and shows degraded like a failed publish, but neither
slows publishing nor drops the subscription (a stray writer breaking the snapshot's key must
not break pub/sub); a failed read is retried with backoff while pushed items go on arriving.
With `reseed`, a snapshot read empty (a Redis restarted without persistence, or expired) is
written again from what this replica holds: `reseed()` gives the items, sent as new ones.

`SharedOverBroadcast` is the base of the features that ride on one channel (shared request
ends, observations, placements, scrapes, calibration, the in-flight push): it owns the
channel and gives each feature `from_url`, `run`, `aclose`, `is_degraded` and `stats`, so a
feature says only what its items are and what it counts beyond the channel.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from extproc.redis_client import redis_from_url
from extproc.redis_loop import Outage, close, command
from extproc.retained import Retained, Retention
from extproc.throttle import Throttle

_TIMEOUT_S = 2.0  # per Redis call
_POLL_S = 1.0  # the longest wait for one message before asking again
_MAX_BACKOFF_S = 2.0


@dataclass(slots=True)
class BroadcastStats:
    """Counters since start: items `published` to the peers, items `dropped` (Redis failing
    or the backlog full), failed Redis calls (`errors`), peers' messages or items that did
    not decode (`malformed`). With a snapshot: successful `snapshot_reads`, the entries they
    handed to `apply` (`snapshot_entries`), items too large to keep (`unretained`), items
    sent again into a snapshot read empty (`reseeded`)."""

    published: int = 0
    dropped: int = 0
    errors: int = 0
    malformed: int = 0
    snapshot_reads: int = 0
    snapshot_entries: int = 0
    unretained: int = 0
    reseeded: int = 0


class Broadcast:
    """Queues this replica's items for the peers and hands each peer item to `apply`. `name`
    names the feature in log lines; `failed_msg` (one `%r`: the error) and `healed_msg`
    (one `%d`: failed exchanges) are its `Outage` lines, logged on `logger`."""

    def __init__(
        self,
        client: Redis,
        channel: str,
        apply: Callable[[Any], None],
        *,
        process_id: str,
        name: str,
        logger: logging.Logger,
        failed_msg: str,
        healed_msg: str,
        interval_s: float = 0.05,
        max_pending: int = 50_000,
        timed: bool = False,
        with_sender: bool = False,
        retention: Retention | None = None,
        reseed: Callable[[], Iterable[Any]] | None = None,
    ) -> None:
        if retention is not None and timed:
            # A snapshot entry has no age a peer could date it by.
            raise ValueError("a timed channel cannot retain a snapshot")
        self._retained = Retained(channel, retention) if retention is not None else None
        self._reseed = reseed
        self._client = client
        self._channel = channel
        self._apply = apply
        self._id = process_id
        self._outage = Outage(
            logger,
            failed_msg=failed_msg,
            healed_msg=healed_msg,
            # Immediate publishing still backs off from a failure at the usual pace.
            base_s=interval_s or 0.05,
            cap_s=_MAX_BACKOFF_S,
        )
        self._name = name
        self._log = logger
        self._throttle = Throttle()
        self._interval = interval_s
        self._max_pending = max_pending
        self._pending: list[Any] = []
        self._timed = timed
        self._with_sender = with_sender
        # Immediate publishing (interval 0): set by `send`, waited on by the publish loop.
        self._wake = asyncio.Event() if interval_s == 0 else None
        self._abandoned: set[asyncio.Task[Any]] = set()  # Redis calls left to end (stop)
        self.stats = BroadcastStats()

    @staticmethod
    def client(url: str) -> Redis:
        """A client for a channel at `url` (no socket timeout: reads wait on `command`)."""
        return redis_from_url(url, cluster=False, connect_timeout_s=1.0, timeout_s=None)  # type: ignore[return-value]

    @property
    def is_degraded(self) -> bool:
        """True while the last publish or read failed: nothing is shared."""
        return self._outage.degraded

    def send(self, item: Any) -> None:
        """Queue `item` (msgpack-encodable) for the next batch."""
        if len(self._pending) >= self._max_pending:
            self.stats.dropped += 1
            self.warn("backlog full: items dropped", "the backlog is full")
            return
        self._pending.append((time.monotonic(), item) if self._timed else item)
        if self._wake is not None:
            self._wake.set()

    async def run(self) -> None:
        await asyncio.gather(self._publish_loop(), self._subscribe_loop())

    async def aclose(self) -> None:
        await close(self._client, self._name, self._abandoned)

    async def _publish_loop(self) -> None:
        delay = self._interval
        wake = self._wake
        while True:
            if delay > 0 or wake is None:
                await asyncio.sleep(delay)
            elif not self._pending and not self._outage.failures("publish"):
                await wake.wait()
            if wake is not None:
                wake.clear()
            if self._pending:
                batch, self._pending = self._pending, []
                if self._timed:
                    now = time.monotonic()
                    batch = [[round(now - t, 4), item] for t, item in batch]
                blob = msgspec.msgpack.encode([self._id, batch])
                backoff = await self._exchange("publish", self._client.publish(self._channel, blob))
                if backoff is None:
                    self.stats.published += len(batch)
                    if self._retained is not None:
                        await self._retain(self._retained, batch)
                else:
                    self.stats.dropped += len(batch)
            elif self._outage.failures("publish"):
                backoff = await self._exchange("publish", self._client.ping())
            else:
                backoff = None
            delay = self._interval if backoff is None else backoff

    async def _retain(self, retained: Retained, batch: list[Any]) -> None:
        """Keeps a published batch in the snapshot. A failure is said and shows degraded
        until a later batch is kept (the peers subscribed got this one; late joiners will
        not: a PING going through would not say the snapshot is whole again) but does not
        slow publishing down: a stray writer breaking the snapshot key must not break
        pub/sub."""
        try:
            too_big = await command(
                retained.write(self._client, self._id, batch), _TIMEOUT_S, self._abandoned
            )
        except (RedisError, OSError, TimeoutError) as exc:
            self.stats.errors += 1
            self.warn("snapshot write failed", f"the snapshot was not written ({exc!r})")
            self._outage.failed(exc, "retain")
            return
        self._outage.healed("retain")
        if too_big:
            self.stats.unretained += too_big
            self.warn("items too large to retain", f"{too_big} items too large for the snapshot")

    async def _read_snapshot(self, retained: Retained) -> float | None:
        """Hands the snapshot's entries to `apply` as pushed items (their checks, their
        counts): None when read, else how long to wait before reading it again (the
        subscription goes on meanwhile: a snapshot a stray writer broke must not stop
        pushed items)."""
        try:
            entries, too_big = await command(
                retained.read(self._client), 2 * _TIMEOUT_S, self._abandoned
            )
        except (RedisError, OSError, TimeoutError) as exc:
            self.stats.errors += 1
            self.warn("snapshot read failed", f"the snapshot was not read ({exc!r})")
            return self._outage.failed(exc, "snapshot")
        self._outage.healed("snapshot")
        self.stats.snapshot_reads += 1
        self.stats.snapshot_entries += len(entries)
        if too_big:
            self.stats.malformed += too_big
            self.warn("snapshot entries too large", f"{too_big} snapshot entries too large")
        for i, entry in enumerate(entries, 1):
            self._received(entry, batch=False)
            if i % 256 == 0:  # thousands of records on start: let requests through meanwhile
                await asyncio.sleep(0)
        if not entries and not too_big and self._reseed is not None:
            # Every replica that reads it empty writes its own back: the peers merge them
            # as any pushed item, the snapshot's bound holds whatever their number.
            items = list(self._reseed())
            for item in items:
                self.send(item)
            self.stats.reseeded += len(items)
            if items:
                self._log.info(
                    "%s: the snapshot was empty; %d items learned here sent again",
                    self._name,
                    len(items),
                )
        return None

    async def _exchange(self, part: str, call: Any) -> float | None:
        """One Redis call of `part`: None when it went through, else how long to back off."""
        try:
            await command(call, _TIMEOUT_S, self._abandoned)
        except (RedisError, OSError, TimeoutError) as exc:
            self.stats.errors += 1
            return self._outage.failed(exc, part)
        self._outage.healed(part)
        return None

    async def _subscribe_loop(self) -> None:
        while True:
            pubsub = self._client.pubsub()
            try:
                await command(pubsub.subscribe(self._channel), _TIMEOUT_S, self._abandoned)
                self._outage.healed("subscribe")
                # Read after subscribing (a record published in between comes twice at
                # worst), after each (re)subscribe: what was said meanwhile is there.
                retained = self._retained
                read_at: float | None = 0.0 if retained is not None else None
                while True:
                    if retained and read_at is not None and time.monotonic() >= read_at:
                        wait = await self._read_snapshot(retained)
                        read_at = None if wait is None else time.monotonic() + wait
                    # A bounded wait per message, never `listen()`: see extproc/redis_loop.py.
                    get = pubsub.get_message(ignore_subscribe_messages=True, timeout=_POLL_S)
                    msg = await command(get, _POLL_S + _TIMEOUT_S, self._abandoned)
                    if msg is not None and msg.get("type") == "message":
                        self._received(msg["data"])
            except (RedisError, OSError, TimeoutError) as exc:
                self.stats.errors += 1
                delay = self._outage.failed(exc, "subscribe")
            finally:
                await close(pubsub, self._name, self._abandoned)
            await asyncio.sleep(delay)

    def _received(self, data: bytes, *, batch: bool = True) -> None:
        """A peer's message `[sender, items]`, or with `batch=False` one snapshot entry
        `[sender, item]`; this replica's own are skipped."""
        try:
            sender, items = msgspec.msgpack.decode(data)
            if not batch:
                items = [items]
            if sender == self._id:
                return
            if self._with_sender and not isinstance(sender, str):
                raise TypeError("sender")
            items = iter(items)
        except (ValueError, TypeError):  # msgspec.DecodeError is a ValueError
            self.stats.malformed += 1
            self.warn("malformed message", "a message on the channel does not decode")
            return
        bad = 0
        for item in items:  # one bad item costs itself, not the rest of its batch
            try:
                if self._with_sender:
                    self._apply((sender, item))
                else:
                    self._apply(item)
            except (ValueError, TypeError):
                bad += 1
        if bad:
            self.stats.malformed += bad
            self.warn("malformed items", f"{bad} malformed items in a peer's batch")

    def warn(self, reason: str, detail: str) -> None:
        """A rate-limited warning on the feature's logger: at most one line per `reason` per
        10 s (a peer can repeat a bad message at will), carrying how many were suppressed."""
        self._throttle.warn(
            self._log, reason, "%s: %s", self._name, detail, extra={"reason": reason}
        )


@dataclass(slots=True)
class ChannelCounts:
    """The counters every feature on a channel has (the first fields of its stats class):
    items `published` to the peers, items `dropped` (Redis failing or the backlog full),
    failed Redis calls (`errors`), peers' messages or items refused (`bad_entries`). In a
    feature's own counts, `errors` and `bad_entries` hold what it counts beyond the
    channel's (a key of its own, items it refuses after decoding); `stats` adds both."""

    published: int = 0
    dropped: int = 0
    errors: int = 0
    bad_entries: int = 0


S = TypeVar("S", bound=ChannelCounts)
P = ParamSpec("P")
F = TypeVar("F")
T = TypeVar("T")


def by_order(plugins: Iterable[object], kind: type[T]) -> dict[str, T]:
    """The plugins of `kind` among a scheduler's, named by their order among them ("0",
    "1", ...): how a feature names a plugin on its channel, so that a peer's item reaches
    the plugin in the same place of the peer's config. Replicas are meant to run one config;
    an item for a name this replica lacks is the feature's to count and say."""
    return {str(i): p for i, p in enumerate(p for p in plugins if isinstance(p, kind))}


class SharedOverBroadcast(Generic[S]):
    """A feature shared with the peer replicas over one `Broadcast` channel. A subclass builds
    its channel with `self._apply` as the callback (its item format), hands it and its own
    counts (a `ChannelCounts` subclass, zeroed) to this `__init__`, and counts in
    `self._counts` what the channel does not see."""

    def __init__(self, counts: S, channel: Broadcast) -> None:
        self._counts = counts
        self._channel = channel

    @classmethod
    def from_url(
        cls: Callable[Concatenate[Redis, P], F], url: str, *args: P.args, **kwargs: P.kwargs
    ) -> F:
        """The feature on a channel client of its own at `url` (the constructor's first
        argument; the others are passed as given)."""
        return cls(Broadcast.client(url), *args, **kwargs)

    @property
    def stats(self) -> S:
        """The feature's counters with the channel's (a copy: safe to keep)."""
        c, own = self._channel.stats, self._counts
        return dataclasses.replace(
            own,
            published=c.published,
            dropped=c.dropped,
            errors=c.errors + own.errors,
            bad_entries=c.malformed + own.bad_entries,
        )

    @property
    def is_degraded(self) -> bool:
        """True while the last publish or read failed: nothing is shared."""
        return self._channel.is_degraded

    async def run(self) -> None:
        await self._channel.run()

    async def aclose(self) -> None:
        await self._channel.aclose()

    def _apply(self, item: Any) -> None:
        """One peer item (a ValueError/TypeError: counted as malformed, skipped)."""
        raise NotImplementedError

    def _refused(self, reason: str) -> None:
        """A peer item that decoded but is refused (unknown server, out of bounds): counted in
        `bad_entries` and said in the channel's rate-limited warning."""
        self._counts.bad_entries += 1
        self._channel.warn(reason, f"a peer's item refused ({reason})")
