"""Redis KV-block index: one index shared by every picker process and replica.

Works on Redis >= 7, Valkey and Redis/Valkey Cluster. Layout (docs/index.md has the costs):
- `<ns>:b:{<root hex>}`: a hash per prefix chain, fields = 8-byte block keys, values = the
  entries holding that block (`tag=deadline_ms`, newline-joined, sorted). Every key of a
  request shares block 0, so one lookup touches one hash, one slot, one round trip (a script
  that bisects rather than walks; field `~` flags chains it must walk, see redis_scripts.py).
- `<ns>:e:{<endpoint>}`: a sorted set per endpoint of (root, key) pairs by last write, for
  capacity and for dropping an endpoint without scanning the keyspace.
Writes go through a bounded queue to one writer loop that pipelines script calls.
Redis bytes stop here: callers see `Lookup` and block keys only.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from array import array
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisError

from extproc.index.base import (
    DEGRADED,
    EMPTY,
    FULL_GROUP,
    GPU,
    GroupSpec,
    IndexOptions,
    IndexStats,
    Lookup,
    entry_tag,
    filter_matches,
)
from extproc.index.lookup_health import LookupHealth
from extproc.index.outage import LOOKUPS, WRITES, Spell
from extproc.index.prefix import Records, Segment, prefix_matches
from extproc.index.redis_scripts import LOOKUP, SHA, TRACK, WRITE
from extproc.redis_client import redis_from_url
from extproc.redis_loop import abandon, close, command, stop

log = logging.getLogger(__name__)

# A Redis lookup slower than its budget is answered degraded and the decision goes on by
# load. The budget follows the measured latency of answered lookups (`LookupHealth`), never
# below the first nor above the second.
DEFAULT_LOOKUP_BUDGET_S = 0.005
DEFAULT_LOOKUP_BUDGET_MAX_S = 0.05
# Timed-out lookups left to finish in the background (their answer is a latency sample and
# proof Redis is alive); beyond this many at once, a timed-out lookup is cancelled.
_MAX_BACKGROUND_LOOKUPS = 64
# A budget's timer that fires this many budgets after the lookup began was late: the event
# loop was starved, and an answer Redis sent in time (or a call not yet sent) would be read
# as a timeout. Such a lookup is waited for one more budget (`lookups_in_grace` when it
# then answers).
_LATE_LOOP = 1.5

_BIG_ENDIAN_HOST = sys.byteorder == "big"
# Member scores are ms since this epoch times 4096, so they stay exact in a double
# (< 2**53) for decades while leaving room to order the blocks of one write tail-first.
_SCORE_EPOCH_MS = 1_704_067_200_000


def _pack(keys: Sequence[int]) -> bytes:
    a = array("Q", keys)
    if _BIG_ENDIAN_HOST:
        a.byteswap()
    return a.tobytes()


def _pack_members(root: int, keys: Sequence[int]) -> bytes:
    a = array("Q", bytes(16 * len(keys)))
    a[0::2] = array("Q", (root,)) * len(keys)
    a[1::2] = array("Q", keys)
    if _BIG_ENDIAN_HOST:
        a.byteswap()
    return a.tobytes()


def _unpack_key(b: bytes) -> int:
    return int.from_bytes(b, "little")


@dataclass(slots=True)
class _Op:
    kind: str  # "s" store, "r" remove tag, "x"/"e" remove endpoint's tags, "D" drop, "F" flush
    endpoint: str = ""
    tag: str = ""
    root: int = 0
    keys: bytes = b""
    members: bytes = b""
    deadline: int = 0
    untrack: bool = False
    blocks: int = 0
    done: asyncio.Future[None] | None = field(default=None)


class RedisKVIndex:
    """A `KVIndex` in Redis, Valkey or a Cluster of either (see `base.KVIndex`).

    `lookup_budget_s` .. `lookup_budget_max_s`: a lookup that takes longer than its budget
    answers degraded (routing goes on load); the budget follows twice the p90 of answered
    lookups within those bounds, and a timed-out lookup finishes in the background
    (`lookup_health.py`). After an error, or timeouts that stay unanswered (a stalled Redis),
    the index answers degraded at once for a short backoff, then tries again, so a dead
    Redis costs requests nothing. `queue_blocks`: the most queued write blocks
    (beyond it writes are dropped and counted). A failed write batch is retried for
    `write_retry_s`, then dropped. The writer loop is `run()` (or use `async with`).
    """

    def __init__(
        self,
        client: Redis | RedisCluster,
        *,
        options: IndexOptions | None = None,
        namespace: str = "extproc:kv",
        lookup_budget_s: float = DEFAULT_LOOKUP_BUDGET_S,
        lookup_budget_max_s: float = DEFAULT_LOOKUP_BUDGET_MAX_S,
        queue_blocks: int = 1_000_000,
        batch_blocks: int = 32_768,
        key_ttl_s: float = 86_400.0,
        write_retry_s: float = 30.0,
        owns_client: bool = False,
    ) -> None:
        self._client = client
        self._opt = options if options is not None else IndexOptions()
        self._ns = namespace
        self._queue_blocks = queue_blocks
        self._batch_blocks = batch_blocks
        self._key_ttl_ms = str(int(key_ttl_s * 1000))
        self._write_retry_s = write_retry_s
        self._owns_client = owns_client
        self._queue: deque[_Op] = deque()
        self._queued_blocks = 0
        self._wake = asyncio.Event()
        self._scripts_loaded = False
        self._parsed: dict[bytes, Records] = {}
        self._health = LookupHealth(lookup_budget_s, lookup_budget_max_s)
        self._task: asyncio.Task[None] | None = None
        self._abandoned: set[asyncio.Task[Any]] = set()  # Redis calls left to end (stop)
        # Per-endpoint capacity from the server's cache config (overrides the option); every
        # replica scrapes the same servers, so they all trim to the same bound.
        self._caps: dict[str, int] = {}
        self.stats = IndexStats()
        st = self.stats
        # Each direction says when it starts failing and when it is back (index/outage.py).
        self._lookups_down = Spell(LOOKUPS, st, log, lambda: (st.lookups_degraded,))
        self._writes_down = Spell(WRITES, st, log, lambda: (st.write_errors, st.writes_dropped))

    @classmethod
    def from_url(cls, url: str, *, cluster: bool = False, **kwargs: Any) -> RedisKVIndex:
        """An index that owns its client. `cluster=True` for Redis/Valkey Cluster."""
        client = redis_from_url(url, cluster=cluster, connect_timeout_s=1.0, timeout_s=2.0)
        return cls(client, owns_client=True, **kwargs)

    async def connect(self, timeout_s: float = 2.0) -> bool:
        """Best-effort warm-up (cluster slot map, scripts) so the first lookup fits its
        budget; False if Redis is not reachable yet (the index still works and retries)."""
        try:
            await command(self._load_scripts(), timeout_s, self._abandoned)
            return True
        except Exception as exc:  # a warm-up, never fatal
            log.warning("kv index: Redis not reachable yet: %r", exc)
            return False

    async def _load_scripts(self) -> None:
        for script in SHA:
            await self._client.script_load(script)
        self._scripts_loaded = True

    async def __aenter__(self) -> RedisKVIndex:
        await self.connect()
        self._task = asyncio.create_task(self.run(), name="kv-index-writer")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            async with asyncio.timeout(5.0):
                await self.flush()
        except TimeoutError:
            log.warning("kv index: %d queued write blocks lost at close", self._queued_blocks)
        finally:
            if self._task is not None:
                await stop([self._task])
                self._task = None
            await self.aclose()

    # -- keys ---------------------------------------------------------------------------

    def _root_key(self, root: int) -> str:
        return f"{self._ns}:b:{{{root:016x}}}"

    def _endpoint_key(self, endpoint: str) -> str:
        return f"{self._ns}:e:{{{endpoint}}}"

    # -- lookup -------------------------------------------------------------------------

    async def lookup(
        self,
        block_keys: Sequence[int],
        endpoints: Collection[str] | None = None,
        *,
        budget_s: float | None = None,
    ) -> Lookup:
        self.stats.lookups += 1
        if not block_keys:
            return EMPTY
        health = self._health
        if health.is_open():
            self.stats.lookups_degraded += 1
            return DEGRADED
        # A task of its own, waited on, not wrapped in asyncio.timeout: redis-py can turn the
        # cancellation into a connection error and retry the command without it (measured:
        # a 5 ms budget took 1.6 s over a 200 ms link while a fresh connection was set up).
        # The decision returns at the budget whatever the client does.
        budget = health.budget(budget_s)
        self.stats.lookup_budget_s = health.budget_s
        started = time.perf_counter()
        task = asyncio.ensure_future(
            self._eval(LOOKUP, self._root_key(block_keys[0]), _pack(block_keys))
        )
        try:
            done, _ = await asyncio.wait((task,), timeout=budget)
            if not done and time.perf_counter() - started > budget * _LATE_LOOP:
                # The loop woke us well past the budget: it was starved (other requests' CPU
                # work, another process), not waiting on Redis; the call may not even have
                # been sent. Redis gets one more budget of a running loop.
                done, _ = await asyncio.wait((task,), timeout=budget)
                if done:
                    self.stats.lookups_in_grace += 1
        except asyncio.CancelledError:
            abandon(task, self._abandoned)
            raise
        if not task.done():
            self._timed_out(task, started)
            return DEGRADED
        exc = task.exception()
        if exc is not None:
            if not isinstance(exc, (RedisError, OSError)):
                raise exc
            self._lookup_failed(exc)
            return DEGRADED
        health.answered(time.perf_counter() - started)
        if self._lookups_down.since is not None:
            self._lookups_down.back(_lookups_skipped)
        out = task.result()
        walked = int(out[-1])
        if walked == 0:
            return EMPTY
        segments: list[Segment] = []
        parsed = self._parsed
        if len(parsed) > 65_536:
            parsed.clear()
        for i in range(0, len(out) - 1, 2):
            raw = out[i + 1]
            records = parsed.get(raw)
            if records is None:
                records = parsed[raw] = _parse_value(raw)
            segments.append((int(out[i]), records))
        o = self._opt
        now_ms = int(o.clock() * 1000)
        matches = prefix_matches(segments, walked, now_ms, o.tier_weights, o.default_tier_weight)
        return Lookup(filter_matches(matches, endpoints))

    def _timed_out(self, task: asyncio.Task[Any], started: float) -> None:
        """The lookup ran out of budget: answered degraded; the call goes on in the background
        (its answer is a latency sample and proof Redis is up), cancelled if too many do."""
        self.stats.lookups_degraded += 1
        self.stats.lookups_timed_out += 1
        if len(self._abandoned) >= _MAX_BACKGROUND_LOOKUPS:
            abandon(task, self._abandoned)
        else:
            self._abandoned.add(task)
            task.add_done_callback(lambda t: self._late(t, started))
        backoff = self._health.timed_out()
        if backoff is not None:
            self._opened(TimeoutError("lookups unanswered"), backoff)

    def _late(self, task: asyncio.Task[Any], started: float) -> None:
        self._abandoned.discard(task)
        if task.cancelled() or task.exception() is not None:
            return  # a dead Redis: the lookups that meet it say so
        seconds = time.perf_counter() - started
        self.stats.lookups_late += 1
        self._health.answered(seconds, late=True)
        self.stats.lookup_budget_s = self._health.budget_s
        if self._health.opens == 0:  # an answer within the cap: Redis is alive
            self._lookups_down.back(_lookups_skipped)

    def _lookup_failed(self, exc: BaseException) -> None:
        self.stats.lookups_degraded += 1
        self.stats.lookups_failed += 1
        self._opened(exc, self._health.failed())

    def _opened(self, exc: BaseException, backoff: float) -> None:
        """The breaker opened: the first time since Redis last answered starts a failing
        spell (said once); a long one is recalled every 100 openings (~100 s at the
        backoff's 1 s cap), never per lookup."""
        spell = self._lookups_down
        if spell.failing(exc, "answered degraded (routed on load) until Redis answers"):
            return
        if self._health.opens % 100 == 0 and spell.since is not None:
            log.warning(
                "kv index: lookups still failing after %.0f s (%r); retry in %.2f s",
                time.monotonic() - spell.since,
                exc,
                backoff,
            )

    async def _eval(self, script: str, key: str, *args: bytes | str) -> Any:
        try:
            return await self._client.evalsha(SHA[script], 1, key, *args)
        except NoScriptError:
            # EVAL both runs and caches the script on the node that owns `key`.
            return await self._client.eval(script, 1, key, *args)

    # -- writes -------------------------------------------------------------------------

    def record(self, endpoint: str, block_keys: Sequence[int]) -> bool:
        if not block_keys:
            return True
        deadline = int((self._opt.clock() + self._opt.approx_ttl_s) * 1000)
        root = block_keys[0]
        return self._put(
            _Op(
                "s",
                endpoint,
                endpoint,
                root,
                _pack(block_keys),
                _pack_members(root, block_keys),
                deadline,
                blocks=len(block_keys),
            )
        )

    def store(
        self,
        endpoint: str,
        block_keys: Sequence[int],
        *,
        root: int,
        medium: str = GPU,
        group: GroupSpec = FULL_GROUP,
    ) -> bool:
        if not block_keys:
            return True
        return self._put(
            _Op(
                "s",
                endpoint,
                entry_tag(endpoint, medium, group),
                root,
                _pack(block_keys),
                _pack_members(root, block_keys),
                0,
                blocks=len(block_keys),
            )
        )

    def remove(
        self,
        endpoint: str,
        block_keys: Sequence[int],
        *,
        root: int,
        medium: str = GPU,
        group: GroupSpec = FULL_GROUP,
        untrack: bool = True,
    ) -> bool:
        if not block_keys:
            return True
        members = _pack_members(root, block_keys) if untrack else b""
        return self._put(
            _Op(
                "r",
                endpoint,
                entry_tag(endpoint, medium, group),
                root,
                _pack(block_keys),
                members,
                0,
                untrack,
                blocks=len(block_keys),
            )
        )

    def set_capacity(self, endpoint: str, blocks: int) -> None:
        """How many of our blocks `endpoint`'s KV cache holds (applied at its next write)."""
        self._caps[endpoint] = blocks

    async def remove_endpoint(self, endpoint: str) -> None:
        self._caps.pop(endpoint, None)
        await self._control(_Op("D", endpoint))

    async def flush(self) -> None:
        await self._control(_Op("F"))

    async def _control(self, op: _Op) -> None:
        op.done = asyncio.get_running_loop().create_future()
        self._queue.append(op)
        self._wake.set()
        await op.done

    def _put(self, op: _Op) -> bool:
        if self._queued_blocks + op.blocks > self._queue_blocks:
            self.stats.writes_dropped += op.blocks
            return False
        self._queue.append(op)
        self._queued_blocks += op.blocks
        self._wake.set()
        return True

    async def run(self) -> None:
        """The writer loop: drains the queue in batches until cancelled."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._queue:
                    await self._drain_once()
        finally:
            for op in self._queue:
                if op.done is not None and not op.done.done():
                    op.done.cancel()

    async def _drain_once(self) -> None:
        batch: list[_Op] = []
        blocks = 0
        queue = self._queue
        while queue and blocks < self._batch_blocks and queue[0].kind not in "DF":
            op = queue.popleft()
            batch.append(op)
            blocks += op.blocks
        self._queued_blocks -= blocks
        if batch:
            await self._apply_with_retry(batch, blocks)
            return
        op = queue.popleft()
        try:
            if op.kind == "D":
                await self._with_retry(lambda: self._drop_endpoint(op.endpoint), 0)
        finally:
            assert op.done is not None
            if not op.done.done():
                op.done.set_result(None)

    async def _apply_with_retry(self, batch: list[_Op], blocks: int) -> None:
        async def apply() -> None:
            evicted = await self._apply(batch)
            while evicted:
                evicted = await self._apply(evicted)

        await self._with_retry(apply, blocks)

    async def _with_retry(self, action: Any, blocks: int) -> None:
        started = time.monotonic()
        delay = 0.05
        while True:
            try:
                # In a task of its own: the writer must stay cancellable (redis_loop.py).
                await command(action(), max(5.0, self._write_retry_s), self._abandoned)
                self.stats.batches += 1
                self._writes_down.back(_writes_skipped)
                return
            except Exception as exc:  # the writer outlives any one batch, bug or outage
                self.stats.write_errors += 1
                # Said once per failing spell (before: a warning at every retry, about one
                # a second for as long as Redis was down); its end says how many failed.
                self._writes_down.failing(
                    exc, f"queued writes wait, each batch retried for {self._write_retry_s:g} s"
                )
                if time.monotonic() - started > self._write_retry_s:
                    self.stats.writes_dropped += blocks
                    log.error("kv index: dropped a write batch of %d blocks: %r", blocks, exc)
                    return
                log.debug("kv index: write failed (%r); retrying in %.2fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)

    async def _apply(self, batch: list[_Op]) -> list[_Op]:
        """Run one batch in one pipeline; returns removals for capacity-evicted blocks."""
        roots: dict[int, list[bytes | str]] = {}
        tracks: dict[str, list[bytes | str]] = {}
        for op in batch:
            roots.setdefault(op.root, []).extend((op.kind, op.tag, str(op.deadline), op.keys))
            if op.members:
                tracks.setdefault(op.endpoint, []).extend(
                    ("a" if op.kind == "s" else "d", op.members)
                )
        now_ms = int(self._opt.clock() * 1000)
        base = str((now_ms - _SCORE_EPOCH_MS) * 4096)
        calls: list[tuple[str, str, list[bytes | str]]] = []
        for root, args in roots.items():
            calls.append((WRITE, self._root_key(root), [self._key_ttl_ms, _pack((root,)), *args]))
        for endpoint, args in tracks.items():
            cap = str(self._caps.get(endpoint, self._opt.capacity_blocks) or 0)
            calls.append(
                (TRACK, self._endpoint_key(endpoint), [base, cap, self._key_ttl_ms, *args])
            )
        results = await self._pipeline(calls)
        evicted: list[_Op] = []
        for (script, key, _), result in zip(calls, results, strict=True):
            if script is TRACK and result:
                endpoint = key[len(self._ns) + 4 : -1]
                evicted.extend(self._drop_ops("e", endpoint, result))
        return evicted

    def _drop_ops(self, kind: str, endpoint: str, members: Sequence[bytes]) -> list[_Op]:
        """`kind` e: capacity evicted `members`; x: the endpoint left."""
        self.stats.evicted_blocks += len(members)
        by_root: dict[bytes, list[bytes]] = {}
        for m in members:
            by_root.setdefault(m[:8], []).append(m[8:])
        return [
            _Op(kind, endpoint, endpoint, _unpack_key(r), b"".join(ks), blocks=len(ks))
            for r, ks in by_root.items()
        ]

    async def _drop_endpoint(self, endpoint: str) -> None:
        key = self._endpoint_key(endpoint)
        while True:
            # Without decode_responses, ZRANGE (no scores) answers raw bytes members; the
            # stub's return type is the union over every option.
            members = cast(list[bytes], await self._client.zrange(key, 0, 4095))
            if not members:
                break
            drops = self._drop_ops("x", endpoint, members)
            calls: list[tuple[str, str, list[bytes | str]]] = [
                (
                    WRITE,
                    self._root_key(op.root),
                    [self._key_ttl_ms, _pack((op.root,)), "x", endpoint, "0", op.keys],
                )
                for op in drops
            ]
            calls.append((TRACK, key, ["0", "0", self._key_ttl_ms, "d", b"".join(members)]))
            await self._pipeline(calls)
        await self._client.delete(key)

    async def _pipeline(self, calls: list[tuple[str, str, list[bytes | str]]]) -> list[Any]:
        """Every call in one pipeline. All our writes are idempotent, so after NOSCRIPT (a
        restarted server forgets scripts) the whole batch is simply sent again."""
        for attempt in (0, 1):
            if attempt or not self._scripts_loaded:
                for script in SHA:
                    await self._client.script_load(script)
                self._scripts_loaded = True
            async with self._client.pipeline(transaction=False) as pipe:
                for script, key, args in calls:
                    # The cluster pipeline refuses .evalsha() but routes a raw EVALSHA by its key.
                    pipe.execute_command("EVALSHA", SHA[script], 1, key, *args)
                try:
                    return await pipe.execute()
                except RedisError as exc:
                    noscript = isinstance(exc, NoScriptError) or "NOSCRIPT" in str(exc)
                    if attempt or not noscript:
                        raise
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        if self._owns_client:
            await close(self._client, "kv index", self._abandoned)


def _lookups_skipped(grown: tuple[int, ...]) -> str:
    return f"{grown[0]} more lookups answered degraded meanwhile"


def _writes_skipped(grown: tuple[int, ...]) -> str:
    return f"{grown[0]} failed write attempts, {grown[1]} blocks dropped meanwhile"


def _parse_value(raw: bytes) -> Records:
    records = []
    for entry in raw.decode().split("\n"):
        tag, _, deadline = entry.rpartition("=")
        records.append((tag, int(deadline)))
    return tuple(records)
