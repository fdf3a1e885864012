"""The KVIndex contract, run against memory, a real Redis and a real 3-master Redis Cluster."""

from __future__ import annotations

import pytest

from extproc.index.base import GroupKind, GroupSpec, IndexOptions, KVIndex

from .conftest import IndexFactory, ManualClock

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def chain(seed: int, n: int) -> list[int]:
    """Distinct fake block keys; `seed` picks the chain (so its root), n its length."""
    return [(seed << 32) + i + 1 for i in range(n)]


async def test_empty_index_matches_nothing(kv_index: KVIndex) -> None:
    assert (await kv_index.lookup(chain(1, 8))).matches == {}
    assert (await kv_index.lookup([])).matches == {}


async def test_recorded_prefix_matches_its_length_per_endpoint(kv_index: KVIndex) -> None:
    keys = chain(1, 10)
    kv_index.record(A, keys)
    kv_index.record(B, keys[:4])
    await kv_index.flush()
    found = await kv_index.lookup(keys)
    assert found.matches == {A: 10.0, B: 4.0}
    assert not found.degraded
    assert (await kv_index.lookup(keys[:3])).matches == {A: 3.0, B: 3.0}


async def test_lookup_beyond_recorded_tail_counts_held_prefix(kv_index: KVIndex) -> None:
    keys = chain(2, 2048)
    kv_index.record(A, keys[:1500])
    await kv_index.flush()
    assert (await kv_index.lookup(keys)).matches == {A: 1500.0}


async def test_endpoint_filter_limits_matches(kv_index: KVIndex) -> None:
    keys = chain(3, 4)
    kv_index.record(A, keys)
    kv_index.record(B, keys)
    await kv_index.flush()
    assert (await kv_index.lookup(keys, endpoints=[B, C])).matches == {B: 4.0}


async def test_match_stops_at_first_missing_block(kv_index: KVIndex) -> None:
    keys = chain(4, 6)
    kv_index.store(A, keys, root=keys[0])
    kv_index.remove(A, keys[2:3], root=keys[0])
    await kv_index.flush()
    assert (await kv_index.lookup(keys)).matches == {A: 2.0}


async def test_tiers_weight_the_match(kv_index: KVIndex) -> None:
    keys = chain(5, 4)
    kv_index.store(A, keys[:2], root=keys[0])
    kv_index.store(A, keys, root=keys[0], medium="CPU")
    kv_index.store(B, keys, root=keys[0], medium="CPU")
    await kv_index.flush()
    found = (await kv_index.lookup(keys)).matches
    assert found[A] == pytest.approx(2 * 1.0 + 2 * 0.8)
    assert found[B] == pytest.approx(4 * 0.8)


async def test_removing_one_tier_keeps_the_other(kv_index: KVIndex) -> None:
    keys = chain(6, 3)
    kv_index.store(A, keys, root=keys[0])
    kv_index.store(A, keys, root=keys[0], medium="CPU")
    kv_index.remove(A, keys, root=keys[0], untrack=False)
    await kv_index.flush()
    assert (await kv_index.lookup(keys)).matches[A] == pytest.approx(3 * 0.8)


async def test_approximate_entries_expire(kv_index: KVIndex, clock: ManualClock) -> None:
    keys = chain(7, 3)
    kv_index.record(A, keys)
    kv_index.store(B, keys, root=keys[0])
    await kv_index.flush()
    clock.advance(61)
    assert (await kv_index.lookup(keys)).matches == {B: 3.0}


async def test_rerecording_refreshes_expiry(kv_index: KVIndex, clock: ManualClock) -> None:
    keys = chain(8, 3)
    kv_index.record(A, keys)
    clock.advance(40)
    kv_index.record(A, keys[:2])
    await kv_index.flush()
    clock.advance(30)
    assert (await kv_index.lookup(keys)).matches == {A: 2.0}


async def test_capacity_evicts_tails_before_heads(
    index_factory: IndexFactory, clock: ManualClock
) -> None:
    index = await index_factory.open(IndexOptions(capacity_blocks=4, clock=clock))
    first, second = chain(9, 6), chain(10, 3)
    index.record(A, first)
    await index.flush()
    assert (await index.lookup(first)).matches == {A: 4.0}
    clock.advance(1)
    index.record(A, second)
    await index.flush()
    assert (await index.lookup(second)).matches == {A: 3.0}
    assert (await index.lookup(first)).matches == {A: 1.0}
    assert index.stats.evicted_blocks == 5


async def test_remove_endpoint_drops_only_that_endpoint(kv_index: KVIndex) -> None:
    one, two = chain(11, 5), chain(12, 5)
    for ep in (A, B):
        kv_index.record(ep, one)
        kv_index.store(ep, two, root=two[0])
        kv_index.store(ep, two, root=two[0], medium="CPU")
    await kv_index.remove_endpoint(A)
    assert (await kv_index.lookup(one)).matches == {B: 5.0}
    assert (await kv_index.lookup(two)).matches == {B: 5.0}


async def test_chain_segment_stored_under_its_root(kv_index: KVIndex) -> None:
    """KV events store a chain in pieces; later pieces name the chain's root."""
    keys = chain(13, 6)
    kv_index.store(A, keys[:2], root=keys[0])
    kv_index.store(A, keys[2:], root=keys[0])
    await kv_index.flush()
    assert (await kv_index.lookup(keys)).matches == {A: 6.0}


async def test_two_indexes_share_one_store(index_factory: IndexFactory, clock: ManualClock) -> None:
    """Two picker processes: one records, the other finds it (memory shares in-process)."""
    options = IndexOptions(clock=clock)
    first, second = await index_factory.open(options), await index_factory.open(options)
    keys = chain(14, 7)
    first.record(A, keys)
    await first.flush()
    assert (await second.lookup(keys)).matches == {A: 7.0}


async def test_sliding_window_group_needs_only_window_blocks(kv_index: KVIndex) -> None:
    keys = chain(15, 8)
    window = GroupSpec(1, GroupKind.SLIDING, window_blocks=2)
    kv_index.store(A, keys, root=keys[0])  # group 0: full attention, all 8 blocks
    kv_index.store(A, keys[5:8], root=keys[0], group=window)  # window kept only the tail
    kv_index.store(B, keys, root=keys[0])
    kv_index.store(B, keys[:3], root=keys[0], group=window)
    await kv_index.flush()
    found = (await kv_index.lookup(keys)).matches
    assert found[A] == 8.0
    assert found[B] == 3.0  # its window group holds nothing past block 2


async def test_state_group_needs_the_block_at_the_cut(kv_index: KVIndex) -> None:
    keys = chain(16, 6)
    state = GroupSpec(1, GroupKind.STATE)
    kv_index.store(A, keys, root=keys[0])
    kv_index.store(A, [keys[1], keys[3]], root=keys[0], group=state)
    await kv_index.flush()
    assert (await kv_index.lookup(keys)).matches == {A: 4.0}
