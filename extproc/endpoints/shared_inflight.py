"""In-flight accounting shared through Redis by every picker process and replica.

Same synchronous interface as `InFlight`, so the router's hot path never awaits Redis: this
process's counts are exact and local; a background loop publishes them and brings back the
other processes' last-known counts. Redis bytes for this feature stop here.

Layout (one hash slot, so it works unchanged on Redis/Valkey Cluster):
- `{<ns>}:load`: hash, field = process id, value = msgpack `{address: [requests, tokens]}`
  in flight ("" when idle).
- `{<ns>}:placed`: hash, field = process id, value = msgpack `{address: [requests, tokens]}`
  ever placed by that process (cumulative counters since it started).
- `{<ns>}:live`: sorted set of process ids scored by their expiry (Redis server time, ms).
One script per pass refreshes our entries, purges expired ones and returns the others, so a
crashed process's load vanishes by itself `ttl_s` after its last publish, with no clock
agreement needed between hosts.

The cumulative counters date the peers' arrivals exactly (peer_arrivals.py): what a peer
placed between two exchanges is the growth of its counters, even when as much of its work
ended meanwhile and its in-flight total did not move. They sit in a key of their own so a
process of an older version (which reads `:load` only, and whose entries have no counters)
and this one share a namespace during a rolling upgrade: each counts the other's load, and
an older peer's arrivals are dated by the growth of its total, as before. Counters that go
backwards (a process restarted under the same id, a stray writer) restart that peer's
dating from its in-flight total, counted and logged (`counter_resets`).

A process forgets its counters for a server it has had nothing in flight on and placed
nothing on for `counters_idle_s` (a pod replaced under Kubernetes leaves its address behind
for good: kept, every exchange would carry every address the pool ever had). A reader takes a
server gone from a peer's counters and its load as pruned, not as counters going back; if the
server comes back, its counters start again from zero. A reader of the previous version
(counters, no pruning) reads the first pruning as a restart: one logged reset per peer.

Pushed placements (endpoints/inflight_push.py): the exchange alone shows a peer's placement
0-2 intervals after it was made (its next write, then this process's next read), and at the
tenants knee three replicas decided 30-56 of 242 requests with a server's queue under its
real backlog because a peer had placed there in the last ~100 ms (bench/RESULTS.md, issue
14, fifteenth session). So each placement's new counters for its server also go to the
peers at decision time (`on_placed`), and `pushed` takes them in at once: what they grew
past everything seen of that peer is in flight and arrives now. The counters are
cumulative, so a push is idempotent and order-free against the exchange: the exchange dates
only growth past the pushed counters, a push the exchange already showed adds nothing
(`push_late`), and pushed growth the peer's exchange has not published yet counts in flight
on top of its entry until it does. Pushed growth no exchange confirms within `ttl_s` (a
forged push, or a peer gone) stops counting (`push_unconfirmed`); pushes are bounded per
message and taken only from peers the exchange knows, so Redis content can skew a count for
at most `ttl_s`. Ends are not pushed: a release is seen at the next exchange, as before
(late, it errs towards a busier server, not an idler one).
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

from extproc.endpoints.inflight import Placement, given_back, rescaled
from extproc.endpoints.peer_arrivals import PeerArrivals
from extproc.redis_client import redis_from_url
from extproc.redis_loop import Outage, close, command
from extproc.throttle import Throttle

log = logging.getLogger(__name__)

# Bounds on one pushed placement's growth past what was seen of its peer (`pushed`): a peer
# pushes after each placement, so honest growth is a request or a few (pushes lost while
# Redis failed and the exchange had not caught up); a prompt is never longer than this.
_MAX_PUSHED_REQUESTS = 64
_MAX_PUSHED_PROMPT = 1 << 23

# KEYS = load hash, live zset, placed hash. ARGV = own id, ttl ms, own blob ("" when idle),
# own counters. Returns [id, load blob, counters blob ("": an older version's entry)] per
# other process with either.
_EXCHANGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local dead = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for i = 1, #dead, 1000 do
  redis.call('HDEL', KEYS[1], unpack(dead, i, math.min(i + 999, #dead)))
  redis.call('HDEL', KEYS[3], unpack(dead, i, math.min(i + 999, #dead)))
end
if #dead > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now) end
redis.call('ZADD', KEYS[2], now + ttl, ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[4])
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('PEXPIRE', KEYS[3], ttl)
local all = redis.call('HGETALL', KEYS[1])
local out = {}
local present = {}
for i = 1, #all, 2 do
  present[all[i]] = true
  if all[i] ~= ARGV[1] then
    local counters = redis.call('HGET', KEYS[3], all[i]) or ''
    if all[i + 1] ~= '' or counters ~= '' then
      out[#out + 1] = all[i]
      out[#out + 1] = all[i + 1]
      out[#out + 1] = counters
    end
  end
end
-- An older version's exchange purges expired ids from the load hash and the live set only.
local placed = redis.call('HKEYS', KEYS[3])
for i = 1, #placed do
  if not present[placed[i]] then redis.call('HDEL', KEYS[3], placed[i]) end
end
return out
"""

# KEYS = load hash, live zset, placed hash. ARGV = own id.
_WITHDRAW = """
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 0
"""

_SHA = {s: hashlib.sha1(s.encode()).hexdigest() for s in (_EXCHANGE, _WITHDRAW)}


class SharedInFlightSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Sharing in-flight counts through Redis.

    `interval_s`: how often counts are exchanged. `ttl_s`: how long a process's published
    load outlives its last publish (default 3 x interval + 0.5 s, so a GC pause does not
    drop a live process). `timeout_s`: per exchange. `max_backoff_s`: retry ceiling while
    Redis is down. `counters_idle_s`: a server's placement counters are forgotten after
    this long with nothing placed there and nothing in flight. `push`: each placement is
    also sent to the peers at once on a Redis pub/sub channel, so they count it within a
    round trip instead of 0-2 intervals (endpoints/inflight_push.py; not on Redis Cluster).
    `namespace`: key prefix; pickers of one pool must share it.
    """

    interval_s: Annotated[float, msgspec.Meta(gt=0)] = 0.05
    ttl_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 0.5
    max_backoff_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    counters_idle_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    push: bool = True
    namespace: Annotated[str, msgspec.Meta(min_length=1, pattern=r"^[^{}]+$")] = "extproc:inflight"

    @property
    def effective_ttl_s(self) -> float:
        return self.ttl_s if self.ttl_s is not None else 3 * self.interval_s + 0.5


@dataclass(slots=True)
class SharedInFlightStats:
    """Counters since start. `peers`: other live processes seen at the last exchange, of
    which `legacy_peers` publish no cumulative counters (an older version). `placed` /
    `placed_tokens`: this process's placements. `peer_arrivals` / `peer_arrived_tokens`:
    the peers' placements as this process dated them (tokens of legacy peers: their totals'
    growth); `peer_growth_tokens`: what the growth of the peers' totals alone would have
    dated (the dating before the counters; the difference is what it hid).
    `counter_resets`: a peer's counters went backwards (restarted under the same id).
    `counters_pruned`: servers whose counters this process forgot (idle for
    `counters_idle_s`). `pushed_arrivals` / `pushed_tokens`: peers' placements counted at
    once from their pushes (within `peer_arrivals` / `peer_arrived_tokens`); `push_late`:
    pushes the exchange had already shown; `push_refused`: pushes from a peer the exchange
    does not know (yet) or growing past the bounds; `push_unconfirmed`: pushed growth no
    exchange confirmed within `ttl_s`, no longer counted."""

    exchanges: int = 0
    errors: int = 0
    bad_entries: int = 0
    peers: int = 0
    legacy_peers: int = 0
    placed: int = 0
    placed_tokens: int = 0
    peer_arrivals: int = 0
    peer_arrived_tokens: int = 0
    peer_growth_tokens: int = 0
    counter_resets: int = 0
    counters_pruned: int = 0
    pushed_arrivals: int = 0
    pushed_tokens: int = 0
    push_late: int = 0
    push_refused: int = 0
    push_unconfirmed: int = 0


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
        self.namespace = settings.namespace
        self._owns_client = owns_client
        self._clock = clock
        self._sleep = sleep
        self._rng = rng or random.Random()
        ns = settings.namespace
        self._keys = (f"{{{ns}}}:load", f"{{{ns}}}:live", f"{{{ns}}}:placed")
        self._requests: Counter[str] = Counter()
        self._tokens: Counter[str] = Counter()
        self._scale = 1.0  # every units change's factor, multiplied (`units_changed`)
        self._local_total = 0
        self._others_requests: dict[str, int] = {}
        self._others_tokens: dict[str, int] = {}
        self._others_total = 0
        # Cumulative counters of this process's placements (published), and their values
        # at the last update of the arrivals (this process's own arrivals since).
        self._placed: dict[str, list[int]] = {}
        self._own_dated: dict[str, int] = {}
        # Per server with nothing in flight here: its placed count and when it was first
        # seen at that count (idle since then; see `_prune`).
        self._idle: dict[str, tuple[int, float]] = {}
        # Per peer id at the last exchange: in flight and counters per address (None: an
        # older version's entry, no counters).
        self._peer_load: dict[str, dict[str, tuple[int, int]]] = {}
        self._peer_counters: dict[str, dict[str, tuple[int, int]] | None] = {}
        self._resets_logged: set[str] = set()
        # Per peer and address, its latest pushed counters past its last exchange's, with
        # when they came: (requests, tokens, seen_at).
        self._pushed: dict[str, dict[str, tuple[int, int, float]]] = {}
        # Called after each placement with its server and this process's counters there
        # (endpoints/inflight_push.py sends them); None: not pushed.
        self.on_placed: Callable[[str, int, int], None] | None = None
        # Called with a peer, a server and how many placements the peer made there, as each
        # push or exchange shows them (server/shared_silence.py counts the fleet's).
        self.on_peer_placed: Callable[[str, str, int], None] | None = None
        self._last_ok = -float("inf")
        # The peers' tokens dated by when each exchange brought them (peer_arrivals.py): how
        # much of them can still be prefill ahead of a new request.
        self.arrivals = PeerArrivals()
        # The peers' placements seen here, cumulative: (requests, their uncached tokens), in
        # pairs only (an older peer's growth of totals has no request count and is left out).
        # `peer_placements` gives them to predicted TTFT's `meanPlacements: fleet`.
        self._peer_placed = (0, 0)
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
        self._throttle = Throttle()  # a bad entry is met at every exchange until it expires

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
        placed = self._placed.get(address)
        if placed is None:
            placed = self._placed[address] = [0, 0]
        placed[0] += 1
        placed[1] += tokens
        self.stats.placed += 1
        self.stats.placed_tokens += tokens
        if self.on_placed is not None:
            self.on_placed(address, placed[0], placed[1])
        return Placement(address, tokens, self._scale)

    def release(self, placement: Placement) -> None:
        a = placement.address
        self._requests[a] -= 1
        self._tokens[a] -= given_back(placement, self._scale)
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

    def units_changed(self, factor: float) -> None:
        """This process's in-flight prompts into a unit `factor` times the old one, as
        `InFlight.units_changed` (published so at the next exchange). The peers' counts are
        theirs to rescale: with pooled calibration they change unit too, and their next
        exchange (one `interval_s`) brings them; the placement counters are cumulative
        and stay as counted."""
        if factor <= 0:
            return
        self._scale *= factor
        self._tokens = rescaled(self._tokens, factor)

    def local_total(self) -> int:
        """In-flight requests placed by this process (exact)."""
        return self._local_total

    def peers(self) -> frozenset[str]:
        """The other processes alive at the last exchange (none once Redis has failed for
        longer than their TTL)."""
        return frozenset(self._peer_load)

    @property
    def is_degraded(self) -> bool:
        """The last exchange with Redis failed: others' counts are old or dropped."""
        return self._outage.degraded

    def pushed(self, peer: str, address: str, requests: int, tokens: int, age_s: float) -> None:
        """`peer`'s placement counters on `address` right after a placement there, pushed at
        decision time and `age_s` old when sent. What they grew past everything seen of the
        peer (its last exchange's counters, its earlier pushes) is in flight from now and
        arrives `age_s` ago; the exchange confirms it later without counting it twice."""
        counted = self._peer_counters.get(peer)
        if counted is None:
            # Unknown to the exchange (not yet seen, gone, an older version): its
            # placements come with its first exchange; a forged id grows nothing.
            self.stats.push_refused += 1
            return
        c_n, c_t = counted.get(address, (0, 0))
        mine = self._pushed.get(peer)
        before = mine.get(address) if mine else None
        if before is not None:
            c_n, c_t = max(c_n, before[0]), max(c_t, before[1])
        d_n, d_t = requests - c_n, tokens - c_t
        if d_n <= 0:
            # Already seen: the exchange (or an earlier push) came first.
            self.stats.push_late += 1
            return
        if d_t < 0 or d_n > _MAX_PUSHED_REQUESTS or d_t > d_n * _MAX_PUSHED_PROMPT:
            self.stats.push_refused += 1
            return
        now = self._clock()
        if mine is None:
            mine = self._pushed[peer] = {}
        mine[address] = (requests, tokens, now)
        self._others_requests[address] = self._others_requests.get(address, 0) + d_n
        self._others_tokens[address] = self._others_tokens.get(address, 0) + d_t
        self._others_total += d_n
        # Its wait in the sender's queue, within one interval (a peer's word, bounded).
        at = now - min(max(0.0, age_s), self._s.interval_s)
        self.arrivals.arrive(address, d_t, at)
        self._placed_by_peers(peer, address, d_n, d_t)
        self.stats.peer_arrivals += d_n
        self.stats.peer_arrived_tokens += d_t
        self.stats.pushed_arrivals += d_n
        self.stats.pushed_tokens += d_t

    # -- the exchange loop -------------------------------------------------------------------

    async def run(self) -> None:
        interval = self._s.interval_s
        while True:
            started = self._clock()
            self._prune(started)
            exchange = self._eval(
                _EXCHANGE, self.process_id, self._ttl_ms, self._blob(), self._counters()
            )
            try:
                entries = await command(exchange, self._s.timeout_s, self._abandoned)
            except (RedisError, OSError, TimeoutError) as exc:
                delay = self._failed(exc)
            else:
                self._merge(entries)
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

    def _prune(self, now: float) -> None:
        """Forgets the counters of servers idle here for `counters_idle_s`. At exchange time,
        not in `acquire`: the hot path stays a few dict updates."""
        idle_s = self._s.counters_idle_s
        for address, (n, _) in list(self._placed.items()):
            if address in self._requests:
                self._idle.pop(address, None)
                continue
            seen = self._idle.get(address)
            if seen is None or seen[0] != n:
                self._idle[address] = (n, now)
            elif now - seen[1] >= idle_s:
                del self._placed[address], self._idle[address]
                self._own_dated.pop(address, None)
                self.stats.counters_pruned += 1

    def _blob(self) -> bytes:
        if not self._requests:
            return b""
        toks = self._tokens
        return msgpack.encode({a: (n, toks.get(a, 0)) for a, n in self._requests.items()})

    def _counters(self) -> bytes:
        return msgpack.encode(self._placed)

    def _bad_entry(self, peer: str, part: str) -> None:
        """A peer's entry (or part of it) that does not decode: counted, and said at most once
        per 10 s per part."""
        self.stats.bad_entries += 1
        self._throttle.warn(
            log, part, "shared in-flight: %s of peer %r do not decode; skipped", part, peer[:64]
        )

    def _merge(self, entries: list[bytes]) -> None:
        reqs: Counter[str] = Counter()
        toks: Counter[str] = Counter()
        arrived: Counter[str] = Counter()
        loads: dict[str, dict[str, tuple[int, int]]] = {}
        counters: dict[str, dict[str, tuple[int, int]] | None] = {}
        for i in range(0, len(entries) - 2, 3):
            peer = entries[i].decode(errors="replace")
            load = _decode(entries[i + 1]) if entries[i + 1] else {}
            if load is None:
                # Another version or a stray writer under our namespace: skip, never fail.
                self._bad_entry(peer, "in-flight counts")
                continue
            placed = _decode(entries[i + 2]) if entries[i + 2] else None
            if placed is None and entries[i + 2]:
                self._bad_entry(peer, "placement counters")  # its load counts; dated by growth
            loads[peer], counters[peer] = load, placed
            for address, (n, t) in load.items():
                reqs[address] += n
                toks[address] += t
            self._date(peer, load, placed, arrived)
            if peer in self._pushed:
                self._unconfirmed(peer, placed, reqs, toks)
        for gone in [p for p in self._pushed if p not in loads]:
            del self._pushed[gone]
        known = {a: self.arrivals.total(a) for a in set(toks) | set(self._others_tokens)}
        self._peer_load, self._peer_counters = loads, counters
        self._resets_logged &= set(loads)
        self._others_requests = dict(reqs)
        self._others_tokens = dict(toks)
        self._others_total = sum(reqs.values())
        self.stats.peer_arrived_tokens += sum(arrived.values())
        self.stats.peer_growth_tokens += sum(max(0, toks.get(a, 0) - k) for a, k in known.items())
        own_arrived = {a: c[1] - self._own_dated.get(a, 0) for a, c in self._placed.items()}
        self._own_dated = {a: c[1] for a, c in self._placed.items()}
        self.arrivals.update(
            self._others_tokens,
            self._clock(),
            own=self._tokens,
            arrived=arrived,
            own_arrived=own_arrived,
        )
        self.stats.exchanges += 1
        self.stats.peers = len(loads)
        self.stats.legacy_peers = sum(c is None for c in counters.values())
        self._last_ok = self._clock()
        self._outage.healed()

    def _unconfirmed(
        self,
        peer: str,
        placed: dict[str, tuple[int, int]] | None,
        reqs: Counter[str],
        toks: Counter[str],
    ) -> None:
        """Adds to `reqs` / `toks` `peer`'s pushed placements its exchange entry does not
        show yet (it wrote the entry before them); forgets pushes it shows, and those no
        entry showed within `ttl_s` (counted: a forged push, or pushes of a peer whose
        exchange stalled)."""
        mine = self._pushed[peer]
        now = self._clock()
        for address, (p_n, p_t, at) in list(mine.items()):
            c_n, c_t = placed.get(address, (0, 0)) if placed is not None else (0, 0)
            if placed is None or c_n >= p_n:
                del mine[address]
            elif now - at > self._ttl_s:
                del mine[address]
                self.stats.push_unconfirmed += 1
            else:
                reqs[address] += p_n - c_n
                toks[address] += max(0, p_t - c_t)
        if not mine:
            del self._pushed[peer]

    def _date(
        self,
        peer: str,
        load: dict[str, tuple[int, int]],
        placed: dict[str, tuple[int, int]] | None,
        arrived: Counter[str],
    ) -> None:
        """Adds to `arrived` the tokens `peer` placed per address since the last exchange:
        the growth of its counters, or without them (an older version) of its totals."""
        before = self._peer_load.get(peer)
        if before is None:
            # First seen (or again after it expired): what it has in flight arrives now.
            for address, (n, t) in load.items():
                arrived[address] += t
                self._placed_by_peers(peer, address, n, t)
                self.stats.peer_arrivals += n
            return
        counted = self._peer_counters.get(peer)
        pushed = self._pushed.get(peer, {})
        if placed is None or counted is None:
            # No counters now or last time (an older version, or undecodable): the growth.
            for address, (_, t) in load.items():
                arrived[address] += max(0, t - before.get(address, (0, 0))[1])
            return
        came: dict[str, tuple[int, int]] = {}
        for address in set(load) | set(placed) | set(counted) | set(before):
            if address not in placed and address not in load:
                continue  # pruned by the peer (idle there): nothing arrived
            n, t = load.get(address, (0, 0))
            n0, t0 = before.get(address, (0, 0))
            c_n, c_t = placed.get(address, (0, 0))
            c_n0, c_t0 = counted.get(address, (0, 0))
            d_n, d_t = c_n - c_n0, c_t - c_t0
            # Ended since: counters minus in flight, now and then; none may go back.
            if min(d_n, d_t, c_n - n, c_t - t, (c_n - n) - (c_n0 - n0),
                   (c_t - t) - (c_t0 - t0)) < 0:  # fmt: skip
                self._reset(peer)
                self._pushed.pop(peer, None)
                came = {a: load.get(a, (0, 0)) for a in load}
                break
            p = pushed.get(address)
            if p is not None:
                # Counted already as far as it was pushed past the last exchange.
                d_n -= max(0, p[0] - c_n0)
                d_t -= max(0, p[1] - c_t0)
            came[address] = (max(0, d_n), max(0, d_t))
        for address, (n, t) in came.items():
            arrived[address] += t
            self._placed_by_peers(peer, address, n, t)
            self.stats.peer_arrivals += n

    def _placed_by_peers(self, peer: str, address: str, requests: int, tokens: int) -> None:
        if requests > 0:
            n, t = self._peer_placed
            self._peer_placed = (n + requests, t + max(0, tokens))
            if self.on_peer_placed is not None:
                self.on_peer_placed(peer, address, requests)

    def peer_placements(self) -> tuple[int, int]:
        """The peers' placements this process has seen (pushed or exchanged), cumulative:
        requests and their uncached tokens (in each peer's estimate units)."""
        return self._peer_placed

    def _reset(self, peer: str) -> None:
        self.stats.counter_resets += 1
        if peer not in self._resets_logged:
            self._resets_logged.add(peer)
            log.warning(
                "shared in-flight: %s's placement counters went backwards (restarted under "
                "the same id?); its in-flight tokens count as arriving now",
                peer,
            )

    def _failed(self, exc: BaseException) -> float:
        self.stats.errors += 1
        delay = self._outage.failed(exc)
        if self._others_requests and self._clock() - self._last_ok > self._ttl_s:
            # Redis would have expired them by now too: stale peers must not pin load.
            self._others_requests = {}
            self._others_tokens = {}
            self._others_total = 0
            self._peer_load, self._peer_counters = {}, {}
            self._pushed.clear()
            self.arrivals.clear()
        return delay

    async def _eval(self, script: str, *args: bytes | str) -> Any:
        try:
            return await self._client.evalsha(_SHA[script], 3, *self._keys, *args)
        except NoScriptError:
            # EVAL runs and caches it (after a Redis restart the cache is empty).
            return await self._client.eval(script, 3, *self._keys, *args)


def _decode(blob: bytes) -> dict[str, tuple[int, int]] | None:
    """`{address: [requests, tokens]}` with non-negative integers, or None."""
    try:
        raw = msgpack.decode(blob)
        out = {str(a): (int(n), int(t)) for a, (n, t) in raw.items()}
    except (ValueError, TypeError, AttributeError, msgspec.DecodeError):
        return None
    if any(n < 0 or t < 0 for n, t in out.values()):
        return None
    return out
