"""One server's prefix cache of KV blocks, modelled on vLLM's block pool: physical blocks,
a hash table of full blocks, a free queue that doubles as the LRU, and an optional CPU tier.

Every change is recorded as a `CacheEvent` in `events`, in the order vLLM publishes them
(evictions before the stores that needed the space); the engine drains them once per
scheduling pass. Not thread-safe: one event loop owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from extproc.sim.blocks import BlockInfo

GPU = "GPU"
CPU = "CPU"


@dataclass(frozen=True, slots=True)
class Stored:
    """Consecutive blocks of one chain became cached on `medium`."""

    blocks: tuple[BlockInfo, ...]
    medium: str = GPU


@dataclass(frozen=True, slots=True)
class Removed:
    hash: bytes
    medium: str = GPU


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


CacheEvent = Stored | Removed | Cleared


@dataclass(slots=True)
class PhysicalBlock:
    id: int
    info: BlockInfo | None = None
    ref: int = 0


@dataclass(frozen=True, slots=True)
class Hit:
    """Leading blocks of a chain found on the GPU, then (continuing) on the CPU tier."""

    gpu: int
    cpu: int


class KVCache:
    """`num_blocks` physical GPU blocks of `block_size` tokens; `cpu_blocks` (0 = off) for
    the offload tier, which receives every hashed block evicted from the GPU.

    A block is referenced while a request holds it. Unreferenced blocks sit in the free
    queue, oldest first; an allocation takes the head and evicts its hash (vLLM frees a
    request's blocks tail first, so a chain is evicted from its end).

    Block 0 is never used: vLLM's block pool takes its first block as the placeholder
    ("null") block, so `num_blocks` holds `usable_blocks` = `num_blocks - 1` blocks of KV.
    Counting all of them kept one block more cached than vLLM once its cache filled
    (tests/vllm/test_agreement.py: the simulator reported one more cached block than vLLM
    for 2-3 requests of 123 whenever the trace filled a server)."""

    def __init__(self, num_blocks: int, block_size: int, cpu_blocks: int = 0) -> None:
        if num_blocks < 2 or block_size <= 0 or cpu_blocks < 0:
            raise ValueError("num_blocks must be at least 2, block_size positive, cpu_blocks >= 0")
        self.num_blocks = num_blocks
        self.usable_blocks = num_blocks - 1
        self.block_size = block_size
        self.cpu_blocks = cpu_blocks
        self.events: list[CacheEvent] = []
        self._blocks = [PhysicalBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._cached: dict[bytes, dict[int, None]] = {}
        self._cpu: OrderedDict[bytes, BlockInfo] = OrderedDict()

    @property
    def usage(self) -> float:
        """Fraction 0..1 of blocks held by requests (cached but unreferenced ones are free,
        as in vLLM's `kv_cache_usage_perc`)."""
        return 1.0 - len(self._free) / self.usable_blocks

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation may take now (cached but unreferenced ones included)."""
        return len(self._free)

    def cost(self, chain: Sequence[BlockInfo], hit: Hit, total_blocks: int) -> int:
        """Free blocks `acquire` would take: `total_blocks` less the GPU hit, plus the hit
        blocks nobody holds (they leave the free queue)."""
        idle_hits = sum(1 for info in chain[: hit.gpu] if self._pick(info.hash).ref == 0)
        return total_blocks - hit.gpu + idle_hits

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def lookup(self, chain: Sequence[BlockInfo], max_blocks: int) -> Hit:
        """How many of the first `max_blocks` blocks of `chain` are cached."""
        limit = min(max_blocks, len(chain))
        gpu = 0
        while gpu < limit and chain[gpu].hash in self._cached:
            gpu += 1
        cpu = 0
        while gpu + cpu < limit and chain[gpu + cpu].hash in self._cpu:
            cpu += 1
        return Hit(gpu, cpu)

    def can_allocate(self, chain: Sequence[BlockInfo], hit: Hit, total_blocks: int) -> bool:
        """Whether `acquire` would find enough free blocks (a hit on an unreferenced block
        takes it out of the free queue, so it counts too)."""
        return self.cost(chain, hit, total_blocks) <= len(self._free)

    def acquire(
        self, chain: Sequence[BlockInfo], hit: Hit, total_blocks: int
    ) -> list[PhysicalBlock]:
        """References the hit blocks, allocates the rest up to `total_blocks` and caches the
        full blocks of `chain` past the GPU hit (CPU-tier hits are loaded back). The caller
        checked `can_allocate`; the returned blocks go back through `release`."""
        held: list[PhysicalBlock] = []
        for info in chain[: hit.gpu]:
            block = self._pick(info.hash)
            if block.ref == 0:
                del self._free[block.id]
            block.ref += 1
            held.append(block)
        for info in chain[hit.gpu : hit.gpu + hit.cpu]:
            self._cpu.move_to_end(info.hash)
        fresh = [self._take_free() for _ in range(total_blocks - hit.gpu)]
        for block in fresh:
            block.ref = 1
        held += fresh
        self.fill(held, chain[hit.gpu :], hit.gpu)
        return held

    def fill(self, held: Sequence[PhysicalBlock], infos: Sequence[BlockInfo], start: int) -> None:
        """Caches `infos` as blocks `start`, `start + 1`, ... of a request's `held` blocks
        (they just became full: prompt blocks at admission, others during decode)."""
        stored: list[BlockInfo] = []
        for i, info in enumerate(infos, start):
            block = held[i]
            block.info = info
            self._cached.setdefault(info.hash, {})[block.id] = None
            stored.append(info)
        if stored:
            self.events.append(Stored(tuple(stored)))

    def release(self, held: Sequence[PhysicalBlock]) -> None:
        """Drops a request's references. Blocks that become unreferenced and hold a cached
        hash join the free queue's tail, the request's last block first, so the end of a
        chain is evicted before its beginning; blocks without one (a partial last block)
        go to its head, to be reused before any cached block is evicted (vLLM 0.32)."""
        uncached: list[int] = []
        for block in reversed(held):
            block.ref -= 1
            if block.ref == 0:
                if block.info is None:
                    uncached.append(block.id)
                else:
                    self._free[block.id] = None
        for block_id in reversed(uncached):  # the head ends up in `uncached` order
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)

    def reset(self) -> None:
        """Forgets every cached hash (POST /reset_prefix_cache); held blocks stay held."""
        for block in self._blocks:
            block.info = None
        self._cached.clear()
        self._cpu.clear()
        self.events.append(Cleared())

    def snapshot(self) -> dict[str, list[tuple[BlockInfo, int, int]]]:
        """`{"GPU": [(info, copies, refs)], "CPU": [(info, 1, 0)]}`, GPU in hash-table order,
        CPU least recently used first."""
        gpu = []
        for ids in self._cached.values():
            blocks = [self._blocks[i] for i in ids]
            info = blocks[0].info
            assert info is not None
            gpu.append((info, len(blocks), sum(b.ref for b in blocks)))
        return {GPU: gpu, CPU: [(info, 1, 0) for info in self._cpu.values()]}

    def _pick(self, h: bytes) -> PhysicalBlock:
        # Prefer a copy someone already holds: it costs no free block.
        ids = self._cached[h]
        blocks = [self._blocks[i] for i in ids]
        return next((b for b in blocks if b.ref > 0), blocks[0])

    def _take_free(self) -> PhysicalBlock:
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.info is not None:
            self._evict(block)
        return block

    def _evict(self, block: PhysicalBlock) -> None:
        info = block.info
        assert info is not None
        block.info = None
        copies = self._cached[info.hash]
        del copies[block.id]
        self.events.append(Removed(info.hash))
        if copies:
            return
        del self._cached[info.hash]
        if not self.cpu_blocks:
            return
        if info.hash in self._cpu:
            self._cpu.move_to_end(info.hash)
            return
        if len(self._cpu) >= self.cpu_blocks:
            old, _ = self._cpu.popitem(last=False)
            self.events.append(Removed(old, CPU))
        self._cpu[info.hash] = info
        self.events.append(Stored((info,), CPU))
