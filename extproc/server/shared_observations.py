"""What each picker replica learns from its own placements, shared with the other replicas
through Redis pub/sub: prefill-speed samples per server and the cold picks of
`no-hit-lru-scorer`.

Behind one gateway each of N replicas places about 1/N of the requests. Learned from that
share alone, the replicas disagree: one run of the agentic workload (bench/trace_replicas.py)
left the same server at 8,800 tok/s on one replica and 72,000 on another, so predicted TTFT
ranked servers differently on each; and each replica's LRU of new-prefix picks spread only
its own new prefixes, so the first picks of the replicas landed on the same servers. Each
replica therefore publishes what it observes and applies the others': every replica's
estimates are drawn from every placement.

On with `state.shared_observations: true` (off by default: in the fifth session's
interleaved runs it made the replicas agree, but TTFT p90 was not measurably better).
The hot path never touches Redis: a sample or a pick is applied locally at once and queued;
one loop publishes the queue every `interval_s` (one message per batch), another applies the
peers' messages as they arrive. Pub/sub keeps nothing in Redis, so its memory is bounded; a
replica that is disconnected misses what was said meanwhile, which costs it a few samples of
a rolling window, no more. Redis down: the replica learns from its own placements alone, says
so in a log line, counts failures and dropped items (`extproc_shared_observations_*`), shows
`extproc_shared_observations_degraded` 1 and reconnects by itself. Redis Cluster: not shared
(pub/sub is per node there), said once in a log line.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from extproc.endpoints.prefill_speed import PrefillSpeeds
from extproc.redis_client import redis_from_url
from extproc.redis_loop import close, command
from extproc.scheduling.plugins.prefix import NoHitLRUScorer

log = logging.getLogger(__name__)

_MAX_PENDING = 50_000
_TIMEOUT_S = 2.0  # per Redis call
_POLL_S = 1.0  # the longest wait for one message before asking again


@dataclass(slots=True)
class SharedObservationsStats:
    """Counters since start: items (samples and picks) `published` to the peers and
    `applied` from them, items `dropped` (Redis failing or backlog full), failed Redis calls
    (`errors`) and undecodable messages (`bad_entries`)."""

    published: int = 0
    applied: int = 0
    dropped: int = 0
    errors: int = 0
    bad_entries: int = 0


class SharedObservations:
    """Publishes this replica's speed samples and cold picks; applies the peers'. `lru` maps
    plugin names to the `no-hit-lru-scorer`s of the scheduler (a peer's pick is applied to
    the plugin of the same name)."""

    def __init__(
        self,
        client: Redis,
        speeds: PrefillSpeeds,
        lru: Mapping[str, NoHitLRUScorer],
        *,
        process_id: str,
        known: Callable[[str], bool] = lambda address: True,
        channel: str = "extproc:observations",
        interval_s: float = 0.05,
    ) -> None:
        self._client = client
        self._speeds = speeds
        self._lru = dict(lru)
        self._id = process_id
        # Peers' items name servers of the pool only: a bad message must not grow the
        # per-server state here without bound.
        self._known = known
        self._channel = channel
        self._interval = interval_s
        self._samples: list[tuple[str, float]] = []
        self._picks: list[tuple[str, str]] = []
        self._abandoned: set[asyncio.Task[Any]] = set()  # Redis calls left to end (stop)
        self._failing = False
        self.stats = SharedObservationsStats()
        speeds.on_sample = self._queue_sample
        for name, plugin in self._lru.items():
            plugin.on_pick = lambda addr, name=name: self._queue_pick(name, addr)

    @classmethod
    def from_url(
        cls,
        url: str,
        speeds: PrefillSpeeds,
        lru: Mapping[str, NoHitLRUScorer],
        *,
        process_id: str,
        known: Callable[[str], bool] = lambda address: True,
    ) -> SharedObservations:
        client = redis_from_url(url, cluster=False, connect_timeout_s=1.0, timeout_s=None)
        return cls(client, speeds, lru, process_id=process_id, known=known)  # type: ignore[arg-type]

    @staticmethod
    def lru_scorers(plugins: Iterable[object]) -> dict[str, NoHitLRUScorer]:
        """The `no-hit-lru-scorer`s of a scheduler's plugins, named by their order among
        them (replicas run the same config)."""
        found = [p for p in plugins if isinstance(p, NoHitLRUScorer)]
        return {str(i): p for i, p in enumerate(found)}

    @property
    def is_degraded(self) -> bool:
        return self._failing

    def _queue_sample(self, address: str, tps: float) -> None:
        if len(self._samples) + len(self._picks) >= _MAX_PENDING:
            self.stats.dropped += 1
            return
        self._samples.append((address, tps))

    def _queue_pick(self, plugin: str, address: str) -> None:
        if len(self._samples) + len(self._picks) >= _MAX_PENDING:
            self.stats.dropped += 1
            return
        self._picks.append((plugin, address))

    async def run(self) -> None:
        await asyncio.gather(self._publish_loop(), self._subscribe_loop())

    async def _publish_loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            if not self._samples and not self._picks:
                continue
            samples, picks = self._samples, self._picks
            self._samples, self._picks = [], []
            blob = msgspec.msgpack.encode([self._id, samples, picks])
            n = len(samples) + len(picks)
            try:
                await command(
                    self._client.publish(self._channel, blob), _TIMEOUT_S, self._abandoned
                )
                self.stats.published += n
                self._recovered()
            except (RedisError, OSError, TimeoutError) as exc:
                self.stats.dropped += n
                self._failed("publish", exc)

    async def _subscribe_loop(self) -> None:
        while True:
            pubsub = self._client.pubsub()
            try:
                await command(pubsub.subscribe(self._channel), _TIMEOUT_S, self._abandoned)
                self._recovered()
                while True:
                    # A bounded wait per message, never `listen()`: see extproc/redis_loop.py.
                    get = pubsub.get_message(ignore_subscribe_messages=True, timeout=_POLL_S)
                    msg = await command(get, _POLL_S + _TIMEOUT_S, self._abandoned)
                    if msg is not None and msg.get("type") == "message":
                        self._apply(msg["data"])
            except (RedisError, OSError, TimeoutError) as exc:
                self._failed("subscription", exc)
                await asyncio.sleep(1.0)
            finally:
                await close(pubsub, "shared observations", self._abandoned)

    def _failed(self, what: str, exc: BaseException) -> None:
        self.stats.errors += 1
        if not self._failing:
            log.warning(
                "shared observations: %s failed (%r); prefill speeds and new-prefix spreading "
                "learn from this replica's placements only until Redis answers",
                what,
                exc,
            )
        self._failing = True

    def _recovered(self) -> None:
        if self._failing:
            log.info("shared observations: Redis answers again")
        self._failing = False

    def _apply(self, data: bytes) -> None:
        try:
            sender, samples, picks = msgspec.msgpack.decode(data)
            if sender == self._id:
                return
            for address, tps in samples:
                if self._known(str(address)):
                    self._speeds.add(str(address), float(tps))
                    self.stats.applied += 1
            for plugin, address in picks:
                lru = self._lru.get(str(plugin))
                if lru is not None and self._known(str(address)):
                    lru.picked(str(address))
                    self.stats.applied += 1
        except (ValueError, TypeError):  # msgspec.DecodeError is a ValueError
            self.stats.bad_entries += 1
            log.warning("shared observations: malformed message on the channel")

    async def aclose(self) -> None:
        await close(self._client, "shared observations", self._abandoned)
