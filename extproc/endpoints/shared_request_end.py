"""Request ends shared between picker replicas through Redis pub/sub.

Behind one gateway, a request's ext_proc stream and its access-log entry can reach different
replicas (Envoy balances each stream on its own). A replica that gets an entry for a request
it does not hold publishes it (batched, every `interval_s`) on one channel; every replica
applies what the others publish, so the replica holding the placement releases it within one
interval instead of at `max_hold_s`. Redis down: entries are dropped (counted), the holds
expire by themselves, the feature says it is degraded (one warning, `is_degraded`, a gauge
on /metrics) and the loops back off and reconnect by themselves.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from extproc.endpoints.request_end import Ended, RequestEnds
from extproc.redis_client import redis_from_url
from extproc.redis_loop import Outage, close, command

log = logging.getLogger("extproc.request_end")

_MAX_PENDING = 50_000
_TIMEOUT_S = 2.0  # per Redis call
_POLL_S = 1.0  # the longest wait for one message before asking again
_MAX_BACKOFF_S = 2.0


@dataclass(slots=True)
class SharedEndStats:
    """Counters since start: entries published to the other replicas, holds released by an
    entry another replica received, entries dropped (Redis failing or backlog full)."""

    published: int = 0
    applied: int = 0
    dropped: int = 0


class SharedRequestEnds:
    """Forwards this replica's unmatched access-log entries and applies the others'."""

    def __init__(
        self,
        ends: RequestEnds,
        client: Redis,
        *,
        process_id: str,
        channel: str = "extproc:request-ends",
        interval_s: float = 0.05,
    ) -> None:
        self._ends = ends
        self._client = client
        self._id = process_id
        self._channel = channel
        self._interval = interval_s
        self._pending: list[Ended] = []
        self._abandoned: set[asyncio.Task[Any]] = set()  # Redis calls left to end (stop)
        self._outage = Outage(
            log,
            failed_msg="request ends: Redis failing (%r); entries for other replicas' "
            "requests are dropped and their holds expire at max_hold_s until it is back",
            healed_msg="request ends: Redis back after %d failed exchanges",
            base_s=interval_s,
            cap_s=_MAX_BACKOFF_S,
        )
        self.stats = SharedEndStats()
        ends.on_unmatched = self.forward

    @property
    def is_degraded(self) -> bool:
        """True while the last publish or read failed: ends are not shared."""
        return self._outage.degraded

    @classmethod
    def from_url(cls, url: str, ends: RequestEnds, *, process_id: str) -> SharedRequestEnds:
        client = redis_from_url(url, cluster=False, connect_timeout_s=1.0, timeout_s=None)
        return cls(ends, client, process_id=process_id)  # type: ignore[arg-type]

    def forward(self, entry: Ended) -> None:
        if len(self._pending) >= _MAX_PENDING:
            self.stats.dropped += 1
            return
        self._pending.append(entry)

    async def run(self) -> None:
        await asyncio.gather(self._publish_loop(), self._subscribe_loop())

    async def _publish_loop(self) -> None:
        delay = self._interval
        while True:
            await asyncio.sleep(delay)
            if self._pending:
                batch, self._pending = self._pending, []
                blob = msgspec.msgpack.encode(
                    [self._id, [(e.request_id, e.ttfb_s, e.upstream) for e in batch]]
                )
                backoff = await self._exchange("publish", self._client.publish(self._channel, blob))
                if backoff is None:
                    self.stats.published += len(batch)
                else:
                    self.stats.dropped += len(batch)
            elif self._outage.failures("publish"):
                # Nothing to send, but the degraded flag must fall once Redis is back.
                backoff = await self._exchange("publish", self._client.ping())
            else:
                backoff = None
            delay = self._interval if backoff is None else backoff

    async def _exchange(self, part: str, call: Any) -> float | None:
        """One Redis call of `part`: None when it went through, else how long to back off."""
        try:
            await command(call, _TIMEOUT_S, self._abandoned)
        except (RedisError, OSError, TimeoutError) as exc:
            return self._outage.failed(exc, part)
        self._outage.healed(part)
        return None

    async def _subscribe_loop(self) -> None:
        while True:
            pubsub = self._client.pubsub()
            try:
                await command(pubsub.subscribe(self._channel), _TIMEOUT_S, self._abandoned)
                self._outage.healed("subscribe")
                while True:
                    # A bounded wait per message, never `listen()`: see extproc/redis_loop.py.
                    get = pubsub.get_message(ignore_subscribe_messages=True, timeout=_POLL_S)
                    msg = await command(get, _POLL_S + _TIMEOUT_S, self._abandoned)
                    if msg is not None and msg.get("type") == "message":
                        self._apply(msg["data"])
            except (RedisError, OSError, TimeoutError) as exc:
                delay = self._outage.failed(exc, "subscribe")
            finally:
                await close(pubsub, "request ends", self._abandoned)
            await asyncio.sleep(delay)

    def _apply(self, data: bytes) -> None:
        try:
            sender, entries = msgspec.msgpack.decode(data)
            if sender == self._id:
                return
            for rid, ttfb, upstream in entries:
                if self._ends.ended(Ended(str(rid), ttfb, str(upstream)), forwarded=True):
                    self.stats.applied += 1
        except (ValueError, TypeError):  # msgspec.DecodeError is a ValueError
            log.warning("request ends: malformed message on the channel")

    async def aclose(self) -> None:
        await close(self._client, "request ends", self._abandoned)
