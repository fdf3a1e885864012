"""vLLM KV-cache events -> index writes: the wire format stops here (precise mode).

`decode_batch` turns one msgpack payload into typed events (positional-array events and
map events with "type" alike; int or bytes hashes). `EventIngest` applies one endpoint's
stream: it recomputes our block keys from `token_ids` (engine hashes are not reproducible,
FACTS 6), keeps engine hash -> our key for BlockRemoved, counts duplicate stores, and
handles sequence gaps (replay or resync) and restarts. Sockets live in `subscriber.py`.
"""

from __future__ import annotations

import logging
import math
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from extproc.hashing.precise import chain_seed, token_block_keys
from extproc.index.base import FULL_GROUP, GPU, GroupKind, GroupSpec, KVIndex
from extproc.throttle import Throttle

log = logging.getLogger(__name__)

Hash = int | bytes


class BlockStored(msgspec.Struct, frozen=True, tag_field="type", tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, frozen=True, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, tag_field="type", tag="AllBlocksCleared"):
    pass


# Until mid-2026 vLLM sent events as positional arrays, tag first; same fields, same order.
class _BlockStoredArray(BlockStored, frozen=True, array_like=True, tag="BlockStored"):
    pass


class _BlockRemovedArray(BlockRemoved, frozen=True, array_like=True, tag="BlockRemoved"):
    pass


class _AllBlocksClearedArray(
    AllBlocksCleared, frozen=True, array_like=True, tag="AllBlocksCleared"
):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared
_map_event = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)
_array_event = msgspec.msgpack.Decoder(
    _BlockStoredArray | _BlockRemovedArray | _AllBlocksClearedArray
)
_batch = msgspec.msgpack.Decoder(list[msgspec.Raw])
_events = msgspec.msgpack.Decoder(list[msgspec.Raw])
_ts = msgspec.msgpack.Decoder(float)


def batch_ts(payload: bytes) -> float | None:
    """The publisher's timestamp of one `[ts, events, dp_rank]` batch; None if unreadable."""
    try:
        parts = _batch.decode(payload)
        return _ts.decode(parts[0]) if parts else None
    except msgspec.DecodeError:
        return None


def decode_batch(payload: bytes) -> tuple[list[Event], int]:
    """Events of one `[ts, events, dp_rank]` batch, and how many events were skipped as
    malformed or unknown. Raises `msgspec.DecodeError` when the batch itself is malformed."""
    parts = _batch.decode(payload)
    if len(parts) < 2:
        raise msgspec.DecodeError("batch has no event list")
    out: list[Event] = []
    skipped = 0
    for raw in _events.decode(parts[1]):
        view = memoryview(raw)
        # msgpack maps are 0x80-0x8f, 0xde, 0xdf; anything else is the array encoding.
        is_map = len(view) > 0 and (0x80 <= view[0] <= 0x8F or view[0] in (0xDE, 0xDF))
        try:
            out.append((_map_event if is_map else _array_event).decode(raw))
        except msgspec.DecodeError:
            skipped += 1
    return out, skipped


@dataclass(slots=True)
class IngestStats:
    """Counters for metrics, summed over every endpoint of a subscriber."""

    messages: int = 0
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    duplicate_stores: int = 0
    orphan_blocks: int = 0  # parent never seen (lost BlockStored): chain cannot be keyed
    unknown_removals: int = 0
    malformed: int = 0  # frames or events that could not be decoded, skipped
    duplicate_messages: int = 0
    late_messages: int = 0  # sequence behind the last and stamped earlier: ignored
    # Seconds from the publisher's batch timestamp to its ingestion, for the latest batch
    # (wall clocks of two hosts: skew shows up here too).
    lag_s: float = 0.0
    gaps: int = 0
    replayed: int = 0
    resyncs: int = 0  # gap not healed by replay: endpoint dropped and rebuilt from new events
    restarts: int = 0
    clears: int = 0
    # Bound socket: messages refused because their topic named no pool endpoint, or came
    # from an address other than the endpoint the topic names (spoofing), or failed CURVE.
    rejected: int = 0
    # Dialed publishers: connections lost (ZMQ reconnects by itself), and how many are down
    # now (subscriber.py says each loss and each return).
    disconnects: int = 0
    publishers_down: int = 0


Replay = Callable[[int], Awaitable[Sequence[tuple[int, bytes]] | None]]
"""Given a start sequence, the buffered (seq, payload) batches from it, or None on failure."""


def group_spec(
    index: int, kind: str | None, window_tokens: int | None, block_size: int
) -> GroupSpec:
    """The index's view of a KV-cache group, from the event fields (see `prefix.py`)."""
    k = (kind or "").lower()
    if ("sliding" in k or "chunked" in k) and window_tokens and block_size > 0:
        return GroupSpec(index, GroupKind.SLIDING, math.ceil(window_tokens / block_size))
    if "mamba" in k or "linear" in k:
        return GroupSpec(index, GroupKind.STATE)
    return FULL_GROUP if index == 0 else GroupSpec(index)


class EventIngest:
    """Applies one endpoint's KV-event stream to the index, in sequence order.

    `model` seeds block 0 of every chain (with the event's `lora_name`), as the request side
    does. One instance per endpoint; not shared between tasks.
    """

    def __init__(
        self,
        index: KVIndex,
        endpoint: str,
        model: str,
        *,
        stats: IngestStats | None = None,
        block_size: int = 16,
        replay: Replay | None = None,
        throttle: Throttle | None = None,
        on_cleared: Callable[[str], None] | None = None,
    ) -> None:
        self._index = index
        # Told the endpoint's engine emptied its prefix cache (AllBlocksCleared), after the
        # index forgot it: the router's figures of what was written there go too.
        self._on_cleared = on_cleared
        # Malformed input is said at most once per reason per 10 s; the subscriber passes its
        # own, so every endpoint's ingest shares one budget of lines.
        self._throttle = throttle if throttle is not None else Throttle()
        self.endpoint = endpoint
        self._model = model
        self._block_size = block_size
        self._replay = replay
        self.stats = stats if stats is not None else IngestStats()
        self.last_seq: int | None = None
        self._last_payload: bytes | None = None  # the batch at `last_seq` (for _is_late)
        # True once an unhealed gap forced a resync: the index then holds only what was
        # stored since (blocks cached before the gap are forgotten, never wrongly kept).
        self.is_stale = False
        # (medium, group_idx) -> engine hash -> [our key, root key, stores - removes]
        self._spaces: dict[tuple[str, int], dict[Hash, list[int]]] = {}
        # (medium, group_idx) -> our key -> engine hashes mapping to it
        self._refs: dict[tuple[str, int], dict[int, int]] = {}
        self._held: dict[int, int] = {}  # our key -> (medium, group) spaces holding it
        self._groups: dict[int, GroupSpec] = {0: FULL_GROUP}
        self._seeds: dict[str | None, int] = {}

    async def handle(self, seq: int, payload: bytes) -> None:
        """One ZMQ message: check its sequence number, then apply its events."""
        last = self.last_seq
        if last is None and seq > 0:
            # The first message seen from this publisher is not its first: a PUB socket
            # that connects drops what it sends before the subscription handshake (vLLM's
            # first batch after every start). Replay fetches the missing head.
            await self._heal_head(seq)
        elif last is not None:
            if seq == last and payload == self._last_payload:
                self.stats.duplicate_messages += 1
                return
            if seq != 0 and seq < last and self._is_late(payload):
                # A message delayed past later ones (already healed by replay, or lost to a
                # resync): applying it would undo newer events, and taking it for a restart
                # would forget everything the endpoint holds.
                self.stats.late_messages += 1
                return
            if seq == 0 or seq <= last:  # the same number with another batch: a new publisher
                self.stats.restarts += 1
                log.info("kv events: %s restarted (seq %d after %d)", self.endpoint, seq, last)
                await self.reset()
                if seq > 0:
                    await self._heal_head(seq)
            elif seq > last + 1:
                self.stats.gaps += 1
                if not await self._heal(last + 1, seq):
                    self.stats.resyncs += 1
                    self.is_stale = True
                    log.warning(
                        "kv events: %s gap %d..%d, resyncing", self.endpoint, last + 1, seq - 1
                    )
                    await self.reset()
        await self._apply(payload)
        self.last_seq = seq

    def _is_late(self, payload: bytes) -> bool:
        """A sequence number behind the last one is a restart (new publisher, sequence from
        0, some of its first messages possibly lost) unless the batch is older than the last
        applied one: a restarted publisher only stamps batches later than its predecessor."""
        if self._last_payload is None:
            return False
        ts, last_ts = batch_ts(payload), batch_ts(self._last_payload)
        return ts is not None and last_ts is not None and ts < last_ts

    async def _heal(self, start: int, seq: int) -> bool:
        if self._replay is None:
            return False
        try:
            batches = await self._replay(start)
        except Exception as exc:  # replay is best effort; the caller resyncs
            log.warning("kv events: replay from %s failed: %r", self.endpoint, exc)
            return False
        if not batches or batches[0][0] != start:
            return False  # the engine's buffer no longer reaches back to `start`
        for s, payload in batches:
            if s >= seq:
                break
            if self.last_seq is not None and s == self.last_seq + 1:
                await self._apply(payload)
                self.last_seq = s
                self.stats.replayed += 1
        return self.last_seq == seq - 1

    async def _heal_head(self, seq: int) -> None:
        """Apply batches 0..seq-1 of a publisher first heard at `seq`, by replay."""
        self.last_seq = None
        if self._replay is None:
            self.stats.gaps += 1
            log.warning(
                "kv events: %s first heard at seq %d and no replay: batches before it are lost",
                self.endpoint,
                seq,
            )
            return
        try:
            batches = await self._replay(0)
        except Exception as exc:  # best effort, as for gaps
            log.warning("kv events: replay from %s failed: %r", self.endpoint, exc)
            batches = None
        for s, payload in batches or ():
            if s >= seq:
                break
            if s == (-1 if self.last_seq is None else self.last_seq) + 1:
                await self._apply(payload)
                self.last_seq = s
                self.stats.replayed += 1
        if self.last_seq != seq - 1:
            self.stats.gaps += 1
            log.warning("kv events: %s batches before seq %d not recovered", self.endpoint, seq)

    async def invalidate(self) -> None:
        """The endpoint's engine restarted or vanished (seen by the scraper): forget its
        blocks and its sequence, so the new publisher's first batch is taken as a start."""
        await self.reset()
        self.last_seq = None
        self._last_payload = None

    async def reset(self) -> None:
        """Forget everything this endpoint holds (restart, clear, unhealed gap)."""
        self._spaces.clear()
        self._refs.clear()
        self._held.clear()
        await self._index.remove_endpoint(self.endpoint)

    async def _apply(self, payload: bytes) -> None:
        self.stats.messages += 1
        self._last_payload = payload  # a reference: timestamps are only read when needed
        try:
            events, skipped = decode_batch(payload)
        except (msgspec.DecodeError, ValueError) as exc:
            self._malformed(1, "batch does not decode", exc)
            return
        if skipped:
            self._malformed(skipped, "events do not decode (or are of an unknown kind)", None)
        self.stats.events += len(events)
        ts = batch_ts(payload)
        if ts is not None and math.isfinite(ts):
            self.stats.lag_s = max(0.0, time.time() - ts)
        for ev in events:
            try:
                if isinstance(ev, BlockStored):
                    self._stored(ev)
                elif isinstance(ev, BlockRemoved):
                    self._removed(ev)
                else:
                    self.stats.clears += 1
                    log.info("kv events: %s cleared its prefix cache", self.endpoint)
                    await self.reset()
                    if self._on_cleared is not None:
                        self._on_cleared(self.endpoint)
            except (TypeError, ValueError, OverflowError, struct.error) as exc:
                # Well-typed but nonsensical (e.g. token ids out of range, which packing
                # refuses with struct.error): skip the event. Raised past here it aborted the
                # batch before its sequence number was taken, so the next one looked like a
                # gap and the endpoint was resynced.
                self._malformed(1, "event makes no sense", exc)

    def _malformed(self, n: int, reason: str, exc: BaseException | None) -> None:
        """`n` frames or events skipped: counted in `malformed`, said at most once per reason
        per 10 s (a broken or hostile publisher repeats at will)."""
        self.stats.malformed += n
        detail = f" ({exc!r})" if exc is not None else ""
        self._throttle.warn(
            log, reason, "kv events: %s from %s: %d skipped%s", reason, self.endpoint, n, detail
        )

    def _stored(self, ev: BlockStored) -> None:
        medium = (ev.medium or GPU).upper()
        gidx = ev.group_idx or 0
        bs = ev.block_size or self._block_size
        group = self._groups.get(gidx)
        if ev.kv_cache_spec_kind is not None or group is None:
            group = self._groups[gidx] = group_spec(
                gidx, ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window, bs
            )
        space_id = (medium, gidx)
        space = self._spaces.get(space_id)
        if space is None:
            space = self._spaces[space_id] = {}
            self._refs[space_id] = {}
        refs = self._refs[space_id]
        hashes = ev.block_hashes
        if ev.parent_block_hash is None:
            parent = self._seed(ev.lora_name)
            root = None
        else:
            entry = space.get(ev.parent_block_hash) or self._find(ev.parent_block_hash)
            if entry is None:
                self.stats.orphan_blocks += len(hashes)
                return
            parent, root = entry[0], entry[1]
        keys = token_block_keys(ev.token_ids, bs, parent, ev.extra_keys)
        if len(keys) != len(hashes):
            self._malformed(1, "token ids do not match the block hashes", None)
            if not keys:
                return
        if root is None:
            root = keys[0]
        new: list[int] = []
        held = self._held
        for h, key in zip(hashes, keys, strict=False):
            entry = space.get(h)
            if entry is not None and entry[0] == key:
                entry[2] += 1  # the engine stored a second physical copy (FACTS 6)
                self.stats.duplicate_stores += 1
                continue
            space[h] = [key, root, 1]
            n = refs.get(key, 0)
            refs[key] = n + 1
            if n == 0:
                held[key] = held.get(key, 0) + 1
                new.append(key)
        self.stats.blocks_stored += len(new)
        if new:
            self._index.store(self.endpoint, new, root=root, medium=medium, group=group)

    def _removed(self, ev: BlockRemoved) -> None:
        medium = (ev.medium or GPU).upper()
        gidx = ev.group_idx or 0
        space = self._spaces.get((medium, gidx))
        if space is None:
            self.stats.unknown_removals += len(ev.block_hashes)
            return
        refs = self._refs[(medium, gidx)]
        held = self._held
        gone: dict[tuple[int, bool], list[int]] = {}
        for h in ev.block_hashes:
            entry = space.get(h)
            if entry is None:
                self.stats.unknown_removals += 1
                continue
            entry[2] -= 1
            if entry[2] > 0:
                continue
            del space[h]
            key, root = entry[0], entry[1]
            n = refs[key] - 1
            if n > 0:
                refs[key] = n
                continue
            del refs[key]
            left = held[key] - 1
            if left:
                held[key] = left
            else:
                del held[key]
            gone.setdefault((root, not left), []).append(key)
        group = self._groups.get(gidx, FULL_GROUP)
        for (root, untrack), keys in gone.items():
            self.stats.blocks_removed += len(keys)
            self._index.remove(
                self.endpoint, keys, root=root, medium=medium, group=group, untrack=untrack
            )

    def _find(self, h: Hash) -> list[int] | None:
        """A parent stored in another medium or group (e.g. offloaded to CPU)."""
        for space in self._spaces.values():
            entry = space.get(h)
            if entry is not None:
                return entry
        return None

    def _seed(self, lora_name: str | None) -> int:
        seed = self._seeds.get(lora_name)
        if seed is None:
            seed = self._seeds[lora_name] = chain_seed(self._model, lora_name)
        return seed
