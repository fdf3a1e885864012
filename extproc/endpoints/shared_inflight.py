"""In-flight accounting shared through Redis by every picker process and replica.

Same synchronous interface as `InFlight`, so the router's hot path never awaits Redis: this
process's counts are exact and local; a background loop publishes them and brings back the
other processes' last-known counts. Redis bytes for this feature stop here.

Layout (one hash slot, so it works unchanged on Redis/Valkey Cluster):
- `{<ns>}:load`: hash, field = process id, value = msgpack `{address: [requests, tokens]}`.
- `{<ns>}:live`: sorted set of process ids scored by their expiry (Redis server time, ms).
One script per pass refreshes our entry, purges expired ones and returns the others, so a
crashed process's load vanishes by itself `ttl_s` after its last publish, with no clock
agreement needed between hosts.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
import socket
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import msgpack
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisError

from extproc.endpoints.inflight import Placement
from extproc.endpoints.peer_arrivals import PeerArrivals
from extproc.redis_client import redis_from_url
from extproc.redis_loop import Outage, close, command

log = logging.getLogger(__name__)

# KEYS = load hash, live zset. ARGV = own id, ttl ms, own blob ("" when idle).
_EXCHANGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local dead = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for i = 1, #dead, 1000 do
  redis.call('HDEL', KEYS[1], unpack(dead, i, math.min(i + 999, #dead)))
end
if #dead > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now) end
redis.call('ZADD', KEYS[2], now + ttl, ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('PEXPIRE', KEYS[2], ttl)
local all = redis.call('HGETALL', KEYS[1])
local out = {}
for i = 1, #all, 2 do
  if all[i] ~= ARGV[1] and all[i + 1] ~= '' then out[#out + 1] = all[i + 1] end
end
return out
"""

# KEYS = load hash, live zset. ARGV = own id.
_WITHDRAW = """
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 0
"""

_SHA = {s: hashlib.sha1(s.encode()).hexdigest() for s in (_EXCHANGE, _WITHDRAW)}


class SharedInFlightSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Sharing in-flight counts through Redis.

    `interval_s`: how often counts are exchanged. `ttl_s`: how long a process's published
    load outlives its last publish (default 3 x interval + 0.5 s, so a GC pause does not
    drop a live process). `timeout_s`: per exchange. `max_backoff_s`: retry ceiling while
    Redis is down. `namespace`: key prefix; pickers of one pool must share it.
    """

    interval_s: Annotated[float, msgspec.Meta(gt=0)] = 0.05
    ttl_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 0.5
    max_backoff_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    namespace: Annotated[str, msgspec.Meta(min_length=1, pattern=r"^[^{}]+$")] = "extproc:inflight"

    @property
    def effective_ttl_s(self) -> float:
        return self.ttl_s if self.ttl_s is not None else 3 * self.interval_s + 0.5


@dataclass(slots=True)
class SharedInFlightStats:
    """Counters since start. `peers`: other live processes seen at the last exchange."""

    exchanges: int = 0
    errors: int = 0
    bad_entries: int = 0
    peers: int = 0


def default_process_id() -> str:
    """Unique per process start: host and pid for people, a random tail so a restarted
    process with a reused pid is never mistaken for its predecessor."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class SharedInFlight:
    """In-flight requests and tokens per endpoint across all picker processes.

    `acquire` / `release` change this process's counts at once; `requests` / `tokens` /
    `total` return own + others' last-known counts (others lag by about one interval).
    `run()` is the exchange loop (until cancelled); `aclose()` withdraws this process's
    load from Redis and closes an owned client. With Redis unreachable the counts are this
    process's own (others' are kept for `ttl_s`, then dropped, as Redis would), errors are
    counted and logged once per outage, and the loop reconnects by itself. Event-loop use
    only, like `InFlight`.
    """

    def __init__(
        self,
        client: Redis | RedisCluster,
        settings: SharedInFlightSettings | None = None,
        *,
        process_id: str | None = None,
        owns_client: bool = False,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self._client = client
        self._s = settings = settings if settings is not None else SharedInFlightSettings()
        self._ttl_s = settings.effective_ttl_s
        self._ttl_ms = str(max(1, round(self._ttl_s * 1000)))
        self.process_id = process_id or default_process_id()
        self._owns_client = owns_client
        self._clock = clock
        self._sleep = sleep
        self._rng = rng or random.Random()
        ns = settings.namespace
        self._keys = (f"{{{ns}}}:load", f"{{{ns}}}:live")
        self._requests: Counter[str] = Counter()
        self._tokens: Counter[str] = Counter()
        self._local_total = 0
        self._others_requests: dict[str, int] = {}
        self._others_tokens: dict[str, int] = {}
        self._others_total = 0
        self._last_ok = -float("inf")
        # The peers' tokens dated by when each exchange brought them (peer_arrivals.py): how
        # much of them can still be prefill ahead of a new request.
        self.arrivals = PeerArrivals()
        self._abandoned: set[asyncio.Task[Any]] = set()  # Redis calls left to end (stop)
        self._outage = Outage(
            log,
            failed_msg="shared in-flight: Redis exchange failed (%r); counting this process's "
            "requests only until it is back",
            healed_msg="shared in-flight: Redis back after %d failed exchanges",
            base_s=settings.interval_s,
            cap_s=settings.max_backoff_s,
            rng=self._rng,
        )
        self.stats = SharedInFlightStats()

    @classmethod
    def from_url(cls, url: str, *, cluster: bool = False, **kwargs: Any) -> SharedInFlight:
        """An instance that owns its client. `cluster=True` for Redis/Valkey Cluster."""
        settings: SharedInFlightSettings = kwargs.get("settings") or SharedInFlightSettings()
        client = redis_from_url(
            url, cluster=cluster, connect_timeout_s=settings.timeout_s, timeout_s=settings.timeout_s
        )
        return cls(client, owns_client=True, **kwargs)

    # -- the hot path (sync, never touches Redis) --------------------------------------------

    def acquire(self, address: str, tokens: int) -> Placement:
        self._requests[address] += 1
        self._tokens[address] += tokens
        self._local_total += 1
        return Placement(address, tokens)

    def release(self, placement: Placement) -> None:
        a = placement.address
        self._requests[a] -= 1
        self._tokens[a] -= placement.tokens
        self._local_total -= 1
        if self._requests[a] <= 0:
            del self._requests[a]
            self._tokens.pop(a, None)

    def requests(self, address: str) -> int:
        return self._requests.get(address, 0) + self._others_requests.get(address, 0)

    def tokens(self, address: str) -> int:
        return self._tokens.get(address, 0) + self._others_tokens.get(address, 0)

    def total(self) -> int:
        """In-flight requests of all processes."""
        return self._local_total + self._others_total

    def local_total(self) -> int:
        """In-flight requests placed by this process (exact)."""
        return self._local_total

    @property
    def is_degraded(self) -> bool:
        """The last exchange with Redis failed: others' counts are old or dropped."""
        return self._outage.degraded

    # -- the exchange loop -------------------------------------------------------------------

    async def run(self) -> None:
        interval = self._s.interval_s
        while True:
            started = self._clock()
            exchange = self._eval(_EXCHANGE, self.process_id, self._ttl_ms, self._blob())
            try:
                blobs = await command(exchange, self._s.timeout_s, self._abandoned)
            except (RedisError, OSError, TimeoutError) as exc:
                delay = self._failed(exc)
            else:
                self._merge(blobs)
                delay = max(0.0, interval - (self._clock() - started))
            await self._sleep(delay)

    async def aclose(self) -> None:
        """Withdraw this process's load (others stop counting it at their next exchange,
        not after the TTL) and close the client if owned. Call after cancelling `run`."""
        try:
            await command(
                self._eval(_WITHDRAW, self.process_id), self._s.timeout_s, self._abandoned
            )
        except (RedisError, OSError, TimeoutError) as exc:
            log.info("shared in-flight: could not withdraw (%r); the TTL will", exc)
        finally:
            if self._owns_client:
                await close(self._client, "shared in-flight", self._abandoned)

    def _blob(self) -> bytes:
        if not self._requests:
            return b""
        toks = self._tokens
        return msgpack.encode({a: (n, toks.get(a, 0)) for a, n in self._requests.items()})

    def _merge(self, blobs: list[bytes]) -> None:
        reqs: Counter[str] = Counter()
        toks: Counter[str] = Counter()
        for blob in blobs:
            try:
                for address, (n, t) in msgpack.decode(blob).items():
                    reqs[address] += int(n)
                    toks[address] += int(t)
            except (ValueError, TypeError, AttributeError, msgspec.DecodeError):
                # Another version or a stray writer under our namespace: skip, never fail.
                self.stats.bad_entries += 1
        self._others_requests = dict(reqs)
        self._others_tokens = dict(toks)
        self._others_total = sum(reqs.values())
        self.arrivals.update(self._others_tokens, self._clock(), own=self._tokens)
        self.stats.exchanges += 1
        self.stats.peers = len(blobs)
        self._last_ok = self._clock()
        self._outage.healed()

    def _failed(self, exc: BaseException) -> float:
        self.stats.errors += 1
        delay = self._outage.failed(exc)
        if self._others_requests and self._clock() - self._last_ok > self._ttl_s:
            # Redis would have expired them by now too: stale peers must not pin load.
            self._others_requests = {}
            self._others_tokens = {}
            self._others_total = 0
            self.arrivals.clear()
        return delay

    async def _eval(self, script: str, *args: bytes | str) -> Any:
        try:
            return await self._client.evalsha(_SHA[script], 2, *self._keys, *args)
        except NoScriptError:
            # EVAL runs and caches it (after a Redis restart the cache is empty).
            return await self._client.eval(script, 2, *self._keys, *args)
