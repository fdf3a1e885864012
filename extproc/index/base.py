"""The KV-block index contract: which endpoint holds which block keys, shared by every picker.

The scheduler asks `lookup` once per request; writes (routing decisions in approximate mode,
KV events in precise mode) are queued and applied off the hot path. Backends: `memory.py`
(in-process, the embedded default) and `redis.py` (shared by every process and replica).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, runtime_checkable

GPU = "GPU"
DEFAULT_TIER_WEIGHTS: Mapping[str, float] = MappingProxyType({"GPU": 1.0, "CPU": 0.8})


@dataclass(frozen=True, slots=True)
class Lookup:
    """Prefix matches of one request.

    `matches` maps endpoint address -> tier-weighted length, in blocks, of the consecutive
    prefix of the request's block keys that the endpoint holds (endpoints without a match are
    absent). `degraded` is True when the index could not answer (e.g. Redis slow or down):
    `matches` is then empty and routing should go on load alone.
    """

    matches: Mapping[str, float]
    degraded: bool = False


DEGRADED = Lookup(MappingProxyType({}), degraded=True)
EMPTY = Lookup(MappingProxyType({}))


class GroupKind(enum.Enum):
    """How a KV-cache group lets the engine reuse a cached prefix (see `prefix.py`)."""

    FULL = "f"  # every block of the prefix is needed (full attention, MLA, unknown kinds)
    SLIDING = "s"  # only the blocks inside the window before the cut
    STATE = "m"  # recurrent state (mamba / linear attention): only the block at the cut


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """A KV-cache group of a (possibly hybrid) model, as KV events describe it.

    `window_blocks` is the sliding window in blocks (SLIDING only). Group 0 with full
    attention is the plain, non-hybrid case and costs nothing extra in the index.
    """

    index: int = 0
    kind: GroupKind = GroupKind.FULL
    window_blocks: int = 0

    @property
    def suffix(self) -> str:
        if self.index == 0 and self.kind is GroupKind.FULL:
            return ""
        if self.kind is GroupKind.SLIDING:
            return f"#{self.index}:{self.kind.value}:{self.window_blocks}"
        return f"#{self.index}:{self.kind.value}"


FULL_GROUP = GroupSpec()


def entry_tag(endpoint: str, medium: str = GPU, group: GroupSpec = FULL_GROUP) -> str:
    """The name an endpoint's copy of a block goes by in the index.

    `ip:port`, then `#<group>:<kind>[:<window>]` unless plain group 0, then `@<MEDIUM>` unless
    GPU. Addresses never contain `#`, `@`, `=` or newlines, so tags parse back unambiguously.
    """
    tag = endpoint + group.suffix
    return tag if medium == GPU else f"{tag}@{medium}"


@dataclass(frozen=True, slots=True)
class IndexOptions:
    """Behaviour shared by every backend.

    `approx_ttl_s`: how long a routing decision (`record`) counts as cached.
    `capacity_blocks`: per endpoint, the most block keys kept; the least recently written go
    first, the tail of a prefix before its head (None = unbounded; meant for approximate mode,
    where the engine does not tell us what it evicted).
    `tier_weights`: weight per medium of a matched block; `default_tier_weight` for the rest.
    `clock`: seconds, injected so tests can step time.
    """

    approx_ttl_s: float = 600.0
    capacity_blocks: int | None = None
    tier_weights: Mapping[str, float] = field(default_factory=lambda: DEFAULT_TIER_WEIGHTS)
    default_tier_weight: float = 0.5
    clock: Callable[[], float] = field(default=time.time, compare=False)


@dataclass(slots=True)
class IndexStats:
    """Counters for metrics: lookups answered degraded, writes dropped on a full queue,
    write batches that failed (and were retried or dropped)."""

    lookups: int = 0
    lookups_degraded: int = 0
    # Why lookups were degraded besides an open breaker (remote backends only): over budget,
    # or an error. Late: a timed-out lookup's answer came back in the background. In grace:
    # answered in a second budget given because the loop woke the first late (starved).
    lookups_timed_out: int = 0
    lookups_failed: int = 0
    lookups_late: int = 0
    lookups_in_grace: int = 0
    lookup_budget_s: float = 0.0
    writes_dropped: int = 0
    write_errors: int = 0
    batches: int = 0
    evicted_blocks: int = 0
    # Remote backends, per direction ("lookups", "writes"; index/outage.py): 1 while it
    # fails (Redis down or refusing), and how many failing spells began.
    degraded: dict[str, int] = field(default_factory=dict)
    outages: dict[str, int] = field(default_factory=dict)


@runtime_checkable
class KVIndex(Protocol):
    """Which endpoints hold which block keys.

    Writes (`record`, `store`, `remove`) never block: they enqueue and return False when the
    bounded queue is full (counted in `stats.writes_dropped`). They are applied in order by
    the backend's writer loop (`run`); `flush` waits until everything queued before it is
    applied. `lookup` never raises because of the backend: it answers degraded instead;
    `budget_s` is what this request's lookup is worth waiting for (a remote backend waits at
    least its configured budget, and up to this).
    `root` is the key of block 0 of the chain the keys belong to (Redis shards by it).
    """

    stats: IndexStats

    async def lookup(
        self,
        block_keys: Sequence[int],
        endpoints: Collection[str] | None = None,
        *,
        budget_s: float | None = None,
    ) -> Lookup: ...

    def record(self, endpoint: str, block_keys: Sequence[int]) -> bool: ...

    def store(
        self,
        endpoint: str,
        block_keys: Sequence[int],
        *,
        root: int,
        medium: str = GPU,
        group: GroupSpec = FULL_GROUP,
    ) -> bool: ...

    def remove(
        self,
        endpoint: str,
        block_keys: Sequence[int],
        *,
        root: int,
        medium: str = GPU,
        group: GroupSpec = FULL_GROUP,
        untrack: bool = True,
    ) -> bool: ...

    async def remove_endpoint(self, endpoint: str) -> None: ...

    async def flush(self) -> None: ...

    async def run(self) -> None: ...

    async def aclose(self) -> None: ...


def check_keys(block_keys: Sequence[int]) -> None:
    """Block keys are unsigned 64-bit: the Redis layout packs them in 8 bytes."""
    if block_keys and not 0 <= min(block_keys) <= max(block_keys) < 1 << 64:
        raise ValueError("block keys must be unsigned 64-bit integers")


def filter_matches(
    matches: dict[str, float], endpoints: Collection[str] | None
) -> Mapping[str, float]:
    if endpoints is not None:
        allowed = endpoints if isinstance(endpoints, set | frozenset | dict) else set(endpoints)
        matches = {ep: n for ep, n in matches.items() if ep in allowed}
    return matches
