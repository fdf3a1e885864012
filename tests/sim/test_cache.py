"""The prefix cache's bookkeeping, driven directly (no HTTP, no clock)."""

from __future__ import annotations

from extproc.sim.blocks import chain_blocks
from extproc.sim.cache import CPU, GPU, Cleared, KVCache, Removed, Stored

BS = 4


def usable(n: int) -> int:
    """A pool whose `n` blocks hold KV: vLLM's pool keeps one more as its null block."""
    return n + 1


def chain(tokens: list[int]):
    return chain_blocks(tokens, BS, "m")


def run(cache: KVCache, tokens: list[int], total_blocks: int | None = None):
    """Admits then finishes one request; returns its hit."""
    c = chain(tokens)
    hit = cache.lookup(c, (len(tokens) - 1) // BS)
    total = total_blocks or cache.blocks_for(len(tokens))
    assert cache.can_allocate(c, hit, total)
    held = cache.acquire(c, hit, total)
    cache.release(held)
    return hit


def test_shared_prefix_hits_and_emits_nothing():
    cache = KVCache(usable(16), BS)
    run(cache, list(range(12)))
    cache.events.clear()
    hit = run(cache, [*range(8), 99, 98, 97, 96, 95])
    assert hit.gpu == 2
    assert cache.events == [Stored(tuple(chain([*range(8), 99, 98, 97, 96])[2:]))]


def test_whole_prompt_hit_recomputes_last_block_as_duplicate_store():
    cache = KVCache(usable(16), BS)
    run(cache, list(range(8)))
    cache.events.clear()
    hit = run(cache, list(range(8)))
    assert hit.gpu == 1  # vLLM always computes the last prompt token
    [stored] = cache.events
    assert isinstance(stored, Stored) and stored.blocks == (chain(list(range(8)))[1],)
    [(_, copies, _), (_, copies2, _)] = cache.snapshot()[GPU]
    assert (copies, copies2) == (1, 2)


def test_lru_eviction_removes_tail_first_before_storing():
    cache = KVCache(usable(4), BS)
    old = chain(list(range(16)))
    run(cache, list(range(16)))
    cache.events.clear()
    new_tokens = list(range(100, 108))
    run(cache, new_tokens)
    removed = [e for e in cache.events if isinstance(e, Removed)]
    assert cache.events[: len(removed)] == removed  # evictions first, then the store
    assert [r.hash for r in removed] == [old[3].hash, old[2].hash]
    assert isinstance(cache.events[-1], Stored)
    assert cache.lookup(old, 4).gpu == 2


def test_held_blocks_are_not_evicted():
    cache = KVCache(usable(4), BS)
    c = chain(list(range(16)))
    held = cache.acquire(c, cache.lookup(c, 3), 4)
    other = chain(list(range(50, 54)))
    assert not cache.can_allocate(other, cache.lookup(other, 0), 1)
    assert cache.usage == 1.0
    cache.release(held)
    assert cache.usage == 0.0


def test_reset_clears_everything_and_says_so():
    cache = KVCache(usable(8), BS)
    run(cache, list(range(9)))
    cache.reset()
    assert cache.events[-1] == Cleared()
    assert cache.snapshot()[GPU] == []
    assert cache.lookup(chain(list(range(9))), 2).gpu == 0


def test_evicted_blocks_move_to_cpu_tier_and_hit_from_there():
    cache = KVCache(usable(3), BS, cpu_blocks=4)
    first = list(range(9))
    run(cache, first)
    run(cache, list(range(100, 109)))
    offloaded = [e for e in cache.events if isinstance(e, Stored) and e.medium == CPU]
    assert offloaded
    hit = cache.lookup(chain(first), 2)
    assert hit.gpu + hit.cpu == 2 and hit.cpu >= 1


def test_one_block_is_vllms_null_block_and_holds_nothing():
    # vLLM's block pool takes its first block as a placeholder: a pool of 3 holds 2 blocks
    # of KV, and its usage counts the 2 (tests/vllm/test_agreement.py checks the effect).
    cache = KVCache(3, BS)
    assert cache.usable_blocks == 2
    c = chain(list(range(8)))
    hit = cache.lookup(c, 1)
    assert cache.can_allocate(c, hit, 2) and not cache.can_allocate(c, hit, 3)
    held = cache.acquire(c, hit, 2)
    assert cache.usage == 1.0
    cache.release(held)
    assert cache.usage == 0.0
