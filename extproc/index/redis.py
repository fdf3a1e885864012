"""Redis KV-block index: one index shared by every picker process and replica.

Works on Redis >= 7, Valkey and Redis/Valkey Cluster. Layout (docs/index.md has the costs):
- `<ns>:b:{<root hex>}`: a hash per prefix chain, fields = 8-byte block keys, values = the
  entries holding that block (`tag=deadline_ms`, newline-joined, sorted). Every key of a
  request shares block 0, so one lookup touches one hash, one slot, one round trip (a script
  that bisects rather than walks; field `~` flags chains it must walk, see _LOOKUP/_WRITE).
- `<ns>:e:{<endpoint>}`: a sorted set per endpoint of (root, key) pairs by last write, for
  capacity and for dropping an endpoint without scanning the keyspace.
Writes go through a bounded queue to one writer loop that pipelines script calls.
Redis bytes stop here: callers see `Lookup` and block keys only.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import sys
import time
from array import array
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
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
from extproc.index.prefix import Records, Segment, prefix_matches

log = logging.getLogger(__name__)

_BIG_ENDIAN_HOST = sys.byteorder == "big"
# Member scores are ms since this epoch times 4096, so they stay exact in a double
# (< 2**53) for decades while leaving room to order the blocks of one write tail-first.
_SCORE_EPOCH_MS = 1_704_067_200_000

# ARGV[1] = little-endian uint64 block keys. Returns [start, value, start, value, ..., walked]:
# one (start, value) per run of equal values, stopping at the first block nobody holds.
#
# Exact linear walks cost ~470 ns per block server-side (2048 keys: 0.98 ms, of which the
# 2048-field HMGET is 0.7 ms: Redis renders every ~200-byte value as RESP and Lua parses it
# back). Chains instead rely on how they are written: `record` stores whole prefixes and
# capacity evicts tails first, so every entry's holdings along a path are a prefix of it and
# a value seen at two blocks is the value of every block between them. The script then finds
# the end of the walk and each run boundary by bisection, O(runs x log n) single-field probes
# (2048 keys, 2 runs: ~13 probes). Writes that can break the prefix shape (see _WRITE) flag
# the chain in field '~'; flagged chains, and any probe pair showing an entry at a later block
# that the earlier block lacks, are walked linearly, so answers equal the exact walk.
_LOOKUP = """
local key, blob = KEYS[1], ARGV[1]
local n = #blob / 8
local out, prev, walked, stopped = {}, false, 0, false
local function emit(pos, v)
  if v ~= prev then
    out[#out + 1] = pos
    out[#out + 1] = v
    prev = v
  end
end
local function field(i) return string.sub(blob, i * 8 + 1, i * 8 + 8) end
-- the exact walk over blocks a..b (0-based, inclusive); stops the lookup at a missing block
local function linear(a, b)
  local c = a
  while c <= b do
    local last = math.min(b, c + 3999)
    local fields = {}
    for i = c, last do fields[#fields + 1] = field(i) end
    local vals = redis.call('HMGET', key, unpack(fields))
    for i = 1, #vals do
      local v = vals[i]
      if not v then
        walked, stopped = c + i - 1, true
        return
      end
      emit(c + i - 1, v)
    end
    c = last + 1
  end
end
local tagsets = {}
local function tags(v)
  local t = tagsets[v]
  if not t then
    t = {}
    for tag in string.gmatch(v, "([^\\n=]+)=%d+") do t[tag] = true end
    tagsets[v] = t
  end
  return t
end
-- true when every entry of later value w is also on earlier value v (the prefix shape)
local function shrinks(v, w)
  local tv = tags(v)
  for tag in pairs(tags(w)) do
    if not tv[tag] then return false end
  end
  return true
end
-- runs of blocks lo+1..hi, given the values at lo (already emitted) and hi
local function fill(lo, vlo, hi, vhi)
  if stopped or vlo == vhi then return end
  if hi == lo + 1 then
    emit(hi, vhi)
    return
  end
  if not shrinks(vlo, vhi) then return linear(lo + 1, hi) end
  local mid = math.floor((lo + hi) / 2)
  local vmid = redis.call('HGET', key, field(mid))
  if not vmid then return linear(lo + 1, hi) end
  fill(lo, vlo, mid, vmid)
  fill(mid, vmid, hi, vhi)
end
local head = redis.call('HMGET', key, '~', field(0), field(n - 1))
local flag, v0, vlast = head[1], head[2], head[3]
if not v0 then return {0} end
if n <= 8 or (flag and string.find(flag, 'i', 1, true)) then
  linear(0, n - 1)
  if not stopped then walked = n end
  out[#out + 1] = walked
  return out
end
emit(0, v0)
walked = n
if not vlast then
  -- the blocks anyone holds form a prefix: bisect for its end
  local lo, hi = 0, n - 1
  vlast = v0
  while hi - lo > 1 do
    local mid = math.floor((lo + hi) / 2)
    local v = redis.call('HGET', key, field(mid))
    if v then lo, vlast = mid, v else hi = mid end
  end
  walked = hi
end
if walked > 1 then fill(0, v0, walked - 1, vlast) end
out[#out + 1] = walked
return out
"""

# ARGV[1] = key ttl ms, ARGV[2] = the chain's root key (8 bytes), then (op, tag, deadline,
# blob) quads; op s = set tag, r = remove tag, x = remove every tag of endpoint `tag` (the
# endpoint left), e = the same for capacity eviction.
# Field '~' flags what _LOOKUP must know: 'i' = holdings may not be prefixes, walk linearly
# (a removal of single blocks, a sliding-window or recurrent-state group, or one entry that is
# both precise and approximate along the chain); 'c' = some store did not start at the root
# or was longer than the 4096 distinct eviction scores, so capacity eviction may cut a hole
# and then sets 'i'. Eviction of whole-prefix writes (record) keeps holdings prefixes.
_WRITE = """
local key, root = KEYS[1], ARGV[2]
local flag = redis.call('HGET', key, '~') or ''
local irregular = string.find(flag, 'i', 1, true) ~= nil
local continued = string.find(flag, 'c', 1, true) ~= nil
local function parse(v)
  local t = {}
  for tag, dl in string.gmatch(v, "([^\\n=]+)=(%d+)") do t[tag] = dl end
  return t
end
local function ser(t)
  local ks = {}
  for k in pairs(t) do ks[#ks + 1] = k end
  if #ks == 0 then return false end
  table.sort(ks)
  for i, k in ipairs(ks) do ks[i] = k .. '=' .. t[k] end
  return table.concat(ks, '\\n')
end
for j = 3, #ARGV, 4 do
  local op, tag, dl, blob = ARGV[j], ARGV[j + 1], ARGV[j + 2], ARGV[j + 3]
  local plen = #tag
  if op == 's' then
    if string.find(tag, '#%d+:[sm]') then irregular = true end
    if string.sub(blob, 1, 8) ~= root or #blob > 8 * 4096 then continued = true end
  elseif op == 'e' and continued then
    irregular = true
  end
  local first, prev_old, prev_new = true, false, false
  for i = 1, #blob / 8 do
    local f = string.sub(blob, i * 8 - 7, i * 8)
    local old = redis.call('HGET', key, f)
    local new
    if not first and old == prev_old then
      new = prev_new
    else
      local t = old and parse(old) or {}
      if op == 's' then
        local was = t[tag]
        if was and (was == '0') ~= (dl == '0') then irregular = true end
        t[tag] = dl
      elseif op == 'r' then
        if t[tag] then irregular = true end
        t[tag] = nil
      else
        for k in pairs(t) do
          local c = string.sub(k, plen + 1, plen + 1)
          if string.sub(k, 1, plen) == tag and (c == '' or c == '#' or c == '@') then t[k] = nil end
        end
      end
      new = ser(t)
      first, prev_old, prev_new = false, old, new
    end
    if new then
      if new ~= old then redis.call('HSET', key, f, new) end
    elseif old then
      redis.call('HDEL', key, f)
    end
  end
end
local newflag = (continued and 'c' or '') .. (irregular and 'i' or '')
if redis.call('HLEN', key) <= (flag ~= '' and 1 or 0) then
  -- nothing left but the flag: the chain is gone
  redis.call('DEL', key)
  return 0
end
if newflag ~= flag then redis.call('HSET', key, '~', newflag) end
redis.call('PEXPIRE', key, ARGV[1])
return 0
"""

# ARGV = score base, capacity (0 = none), key ttl ms, then (op, blob) pairs; op a = touch,
# d = forget; blob = 16-byte (root, key) members, head first. Returns evicted members.
# ZADD GT keeps each member's highest score: a replica whose clock lags must not score a
# refreshed head below its tail, or eviction would cut holes that _LOOKUP does not expect.
_TRACK = """
local key = KEYS[1]
local base, cap = tonumber(ARGV[1]), tonumber(ARGV[2])
for j = 4, #ARGV, 2 do
  local op, blob = ARGV[j], ARGV[j + 1]
  local cmd = op == 'a' and 'ZADD' or 'ZREM'
  local args = op == 'a' and {'GT'} or {}
  local base_len = #args
  for i = 1, #blob / 16 do
    local m = string.sub(blob, i * 16 - 15, i * 16)
    if op == 'a' then args[#args + 1] = base + 4095 - math.min(i - 1, 4095) end
    args[#args + 1] = m
    if #args >= 4000 then
      redis.call(cmd, key, unpack(args))
      args = op == 'a' and {'GT'} or {}
    end
  end
  if #args > base_len then redis.call(cmd, key, unpack(args)) end
end
local evicted = {}
if cap > 0 then
  local size = redis.call('ZCARD', key)
  if size > cap then
    evicted = redis.call('ZRANGE', key, 0, size - cap - 1)
    redis.call('ZREMRANGEBYRANK', key, 0, size - cap - 1)
  end
end
if redis.call('EXISTS', key) == 1 then redis.call('PEXPIRE', key, ARGV[3]) end
return evicted
"""


_SHA = {s: hashlib.sha1(s.encode()).hexdigest() for s in (_LOOKUP, _WRITE, _TRACK)}


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

    `lookup_budget_s`: a lookup that takes longer answers degraded (routing goes on load);
    after a failure the index answers degraded at once for a short backoff, then tries again,
    so a dead Redis costs requests nothing. `queue_blocks`: the most queued write blocks
    (beyond it writes are dropped and counted). A failed write batch is retried for
    `write_retry_s`, then dropped. The writer loop is `run()` (or use `async with`).
    """

    def __init__(
        self,
        client: Redis | RedisCluster,
        *,
        options: IndexOptions | None = None,
        namespace: str = "extproc:kv",
        lookup_budget_s: float = 0.005,
        queue_blocks: int = 1_000_000,
        batch_blocks: int = 32_768,
        key_ttl_s: float = 86_400.0,
        write_retry_s: float = 30.0,
        owns_client: bool = False,
    ) -> None:
        self._client = client
        self._opt = options or IndexOptions()
        self._ns = namespace
        self._budget_s = lookup_budget_s
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
        self._retry_at = 0.0
        self._failures = 0
        self._task: asyncio.Task[None] | None = None
        self.stats = IndexStats()

    @classmethod
    def from_url(cls, url: str, *, cluster: bool = False, **kwargs: Any) -> RedisKVIndex:
        """An index that owns its client. `cluster=True` for Redis/Valkey Cluster."""
        common: dict[str, Any] = {
            "socket_connect_timeout": 1.0,
            "socket_timeout": 2.0,
            # One immediate retry heals a connection Redis closed (restart); longer outages
            # are the circuit breaker's business, not the client's.
            "retry": Retry(NoBackoff(), 1),
        }
        client: Redis | RedisCluster
        if cluster:
            client = RedisCluster.from_url(url, **common)
        else:
            client = Redis.from_url(url, health_check_interval=0, **common)
        return cls(client, owns_client=True, **kwargs)

    async def connect(self, timeout_s: float = 2.0) -> bool:
        """Best-effort warm-up (cluster slot map, scripts) so the first lookup fits its
        budget; False if Redis is not reachable yet (the index still works and retries)."""
        try:
            async with asyncio.timeout(timeout_s):
                for script in _SHA:
                    await self._client.script_load(script)  # type: ignore[misc]
                self._scripts_loaded = True
                return True
        except Exception as exc:  # a warm-up, never fatal
            log.warning("kv index: Redis not reachable yet: %r", exc)
            return False

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
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
                self._task = None
            await self.aclose()

    # -- keys ---------------------------------------------------------------------------

    def _root_key(self, root: int) -> str:
        return f"{self._ns}:b:{{{root:016x}}}"

    def _endpoint_key(self, endpoint: str) -> str:
        return f"{self._ns}:e:{{{endpoint}}}"

    # -- lookup -------------------------------------------------------------------------

    async def lookup(
        self, block_keys: Sequence[int], endpoints: Collection[str] | None = None
    ) -> Lookup:
        self.stats.lookups += 1
        if not block_keys:
            return EMPTY
        now = time.monotonic()
        if now < self._retry_at:
            self.stats.lookups_degraded += 1
            return DEGRADED
        # Waited on, not wrapped in asyncio.timeout: redis-py can turn the cancellation into
        # a connection error and retry the command without it (measured: a 5 ms budget took
        # 1.6 s over a 200 ms link while a fresh connection was set up). The decision returns
        # at the budget whatever the client does; the abandoned call is cancelled.
        call = asyncio.ensure_future(
            self._eval(_LOOKUP, self._root_key(block_keys[0]), _pack(block_keys))
        )
        try:
            done, _ = await asyncio.wait((call,), timeout=self._budget_s)
        except asyncio.CancelledError:
            call.cancel()
            raise
        if not done:
            call.cancel()
            call.add_done_callback(_retrieve)
            self._lookup_failed(TimeoutError())
            return DEGRADED
        try:
            out = call.result()
        except (RedisError, OSError) as exc:
            self._lookup_failed(exc)
            return DEGRADED
        self._failures = 0
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

    def _lookup_failed(self, exc: BaseException) -> None:
        self.stats.lookups_degraded += 1
        self._failures += 1
        # A lone slow answer (GC pause, busy core) should not open the breaker.
        if isinstance(exc, TimeoutError) and self._failures < 3:
            return
        backoff = min(1.0, 0.05 * 2 ** min(self._failures, 5))
        self._retry_at = time.monotonic() + backoff
        if self._failures in (1, 3) or self._failures % 100 == 0:
            log.warning("kv index: lookup degraded (%r); retry in %.2fs", exc, backoff)

    async def _eval(self, script: str, key: str, *args: bytes | str) -> Any:
        try:
            return await self._client.evalsha(_SHA[script], 1, key, *args)  # type: ignore[misc]
        except NoScriptError:
            # EVAL both runs and caches the script on the node that owns `key`.
            return await self._client.eval(script, 1, key, *args)  # type: ignore[misc]

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

    async def remove_endpoint(self, endpoint: str) -> None:
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
                await action()
                self.stats.batches += 1
                return
            except Exception as exc:  # the writer outlives any one batch, bug or outage
                self.stats.write_errors += 1
                if time.monotonic() - started > self._write_retry_s:
                    self.stats.writes_dropped += blocks
                    log.error("kv index: dropped a write batch of %d blocks: %r", blocks, exc)
                    return
                log.warning("kv index: write failed (%r); retrying in %.2fs", exc, delay)
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
        cap = str(self._opt.capacity_blocks or 0)
        calls: list[tuple[str, str, list[bytes | str]]] = []
        for root, args in roots.items():
            calls.append((_WRITE, self._root_key(root), [self._key_ttl_ms, _pack((root,)), *args]))
        for endpoint, args in tracks.items():
            calls.append(
                (_TRACK, self._endpoint_key(endpoint), [base, cap, self._key_ttl_ms, *args])
            )
        results = await self._pipeline(calls)
        evicted: list[_Op] = []
        for (script, key, _), result in zip(calls, results, strict=True):
            if script is _TRACK and result:
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
            members = await self._client.zrange(key, 0, 4095)  # type: ignore[misc]
            if not members:
                break
            drops = self._drop_ops("x", endpoint, members)
            calls = [
                (
                    _WRITE,
                    self._root_key(op.root),
                    [self._key_ttl_ms, _pack((op.root,)), "x", endpoint, "0", op.keys],
                )
                for op in drops
            ]
            calls.append((_TRACK, key, ["0", "0", self._key_ttl_ms, "d", b"".join(members)]))
            await self._pipeline(calls)
        await self._client.delete(key)  # type: ignore[misc]

    async def _pipeline(self, calls: list[tuple[str, str, list[bytes | str]]]) -> list[Any]:
        """Every call in one pipeline. All our writes are idempotent, so after NOSCRIPT (a
        restarted server forgets scripts) the whole batch is simply sent again."""
        for attempt in (0, 1):
            if attempt or not self._scripts_loaded:
                for script in _SHA:
                    await self._client.script_load(script)  # type: ignore[misc]
                self._scripts_loaded = True
            async with self._client.pipeline(transaction=False) as pipe:
                for script, key, args in calls:
                    # The cluster pipeline refuses .evalsha() but routes a raw EVALSHA by its key.
                    pipe.execute_command("EVALSHA", _SHA[script], 1, key, *args)
                try:
                    return await pipe.execute()
                except RedisError as exc:
                    noscript = isinstance(exc, NoScriptError) or "NOSCRIPT" in str(exc)
                    if attempt or not noscript:
                        raise
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Done-callback of an abandoned lookup: consume its outcome (no 'never retrieved')."""
    if not task.cancelled():
        task.exception()


def _parse_value(raw: bytes) -> Records:
    records = []
    for entry in raw.decode().split("\n"):
        tag, _, deadline = entry.rpartition("=")
        records.append((tag, int(deadline)))
    return tuple(records)
