"""The Redis lookup searches chains by bisection instead of walking every block: its answers
must equal the exact walk (the memory backend) for every history, including holdings that are
not prefixes (holes, window and state groups), which must send the lookup to the linear walk."""

from __future__ import annotations

import random

import pytest

from extproc.index.base import GroupKind, GroupSpec, IndexOptions
from extproc.index.memory import MemoryKVIndex
from extproc.index.redis import RedisKVIndex

from .conftest import IndexFactory, ManualClock

ENDPOINTS = [f"10.0.0.{i}:8000" for i in range(1, 6)]
# These tests check answers, not speed: a busy test machine must not turn them degraded.
BUDGET_S = 2.0
GROUPS = [GroupSpec(), GroupSpec(1, GroupKind.SLIDING, 3), GroupSpec(2, GroupKind.STATE)]


@pytest.fixture(params=["redis", "cluster"])
def redis_factory(request: pytest.FixtureRequest) -> IndexFactory:
    fixture = "redis_server" if request.param == "redis" else "redis_cluster"
    return IndexFactory(request.param, request.getfixturevalue(fixture).url)


def tree(rng: random.Random, seed: int, paths: int, length: int) -> list[list[int]]:
    """Paths through one chain: each branches off an earlier one at a random block."""
    out = [[(seed << 40) + i for i in range(length)]]
    for p in range(1, paths):
        base = rng.choice(out)
        cut = rng.randrange(1, length)
        out.append(base[:cut] + [(seed << 40) + (p << 20) + i for i in range(length - cut)])
    return out


async def assert_same_answers(
    ref: MemoryKVIndex, index: RedisKVIndex, paths: list[list[int]], rng: random.Random
) -> None:
    for path in paths:
        for n in {len(path), rng.randrange(1, len(path) + 1), rng.randrange(1, 12)}:
            want = (await ref.lookup(path[:n])).matches
            got = await index.lookup(path[:n])
            assert not got.degraded
            assert got.matches == pytest.approx(want), (n, path[0])


@pytest.mark.parametrize("seed", range(6))
async def test_approximate_histories_match_the_exact_walk(
    redis_factory: IndexFactory, seed: int
) -> None:
    """Records, expiry, capacity and departures keep holdings prefixes: the bisection path."""
    rng = random.Random(seed)
    ref_clock, clock = ManualClock(), ManualClock()
    capacity = rng.choice([None, 300])
    ref = MemoryKVIndex(IndexOptions(approx_ttl_s=60, capacity_blocks=capacity, clock=ref_clock))
    index = await redis_factory.open(
        IndexOptions(approx_ttl_s=60, capacity_blocks=capacity, clock=clock),
        lookup_budget_s=BUDGET_S,
    )
    assert isinstance(index, RedisKVIndex)
    try:
        paths = tree(rng, seed + 1, 4, rng.choice([40, 700]))
        for _ in range(40):
            dt = rng.choice([0.002, 0.002, 5.0, 25.0])
            ref_clock.advance(dt)
            clock.advance(dt)
            ep = rng.choice(ENDPOINTS)
            if rng.random() < 0.05:
                await ref.remove_endpoint(ep)
                await index.remove_endpoint(ep)
                continue
            keys = rng.choice(paths)[: rng.randrange(1, 700)]
            ref.record(ep, keys)
            index.record(ep, keys)
            await index.flush()  # one write per batch, so eviction order matches memory's
        await assert_same_answers(ref, index, paths, rng)
    finally:
        await index.__aexit__(None, None, None)


@pytest.mark.parametrize("seed", range(6))
async def test_precise_histories_with_holes_match_the_exact_walk(
    redis_factory: IndexFactory, seed: int
) -> None:
    """Stores of chain pieces, single-block removals, tiers and hybrid groups."""
    rng = random.Random(100 + seed)
    clock = ManualClock()
    ref = MemoryKVIndex(IndexOptions(approx_ttl_s=60, clock=clock))
    index = await redis_factory.open(
        IndexOptions(approx_ttl_s=60, clock=clock), lookup_budget_s=BUDGET_S
    )
    assert isinstance(index, RedisKVIndex)
    try:
        paths = tree(rng, 50 + seed, 3, 300)
        for ep in ENDPOINTS[:3]:  # long equal runs, so that holes hide between equal probes
            for path in paths:
                ref.store(ep, path, root=path[0])
                index.store(ep, path, root=path[0])
        for _ in range(30):
            path = rng.choice(paths)
            ep, medium = rng.choice(ENDPOINTS[:3]), rng.choice(["GPU", "CPU"])
            group = rng.choice(GROUPS) if seed % 2 else GroupSpec()
            a = rng.randrange(0, len(path))
            b = rng.randrange(a + 1, len(path) + 1)
            if rng.random() < 0.3:
                gone = rng.sample(path[a:b], min(b - a, rng.randrange(1, 4)))
                ref.remove(ep, gone, root=path[0], medium=medium, group=group)
                index.remove(ep, gone, root=path[0], medium=medium, group=group)
            elif rng.random() < 0.2:
                ref.record(ep, path[:b])
                index.record(ep, path[:b])
            else:
                ref.store(ep, path[a:b], root=path[0], medium=medium, group=group)
                index.store(ep, path[a:b], root=path[0], medium=medium, group=group)
        await index.flush()
        await assert_same_answers(ref, index, paths, rng)
    finally:
        await index.__aexit__(None, None, None)


async def test_hole_between_two_equal_blocks_ends_the_match(redis_factory: IndexFactory) -> None:
    """Blocks 0 and 599 carry the same entries; only a walk sees that A lost block 300."""
    index = await redis_factory.open(IndexOptions(), lookup_budget_s=BUDGET_S)
    try:
        a, b = ENDPOINTS[:2]
        keys = [(7 << 40) + i for i in range(600)]
        index.store(a, keys, root=keys[0])
        index.store(b, keys, root=keys[0])
        index.remove(a, keys[300:301], root=keys[0])
        await index.flush()
        assert (await index.lookup(keys)).matches == {a: 300.0, b: 600.0}
    finally:
        await index.__aexit__(None, None, None)


async def test_unflagged_non_prefix_holdings_fall_back_to_the_walk(
    redis_factory: IndexFactory,
) -> None:
    """A chain written without the flag (an older version) whose probes show an entry at a
    later block that an earlier block lacks is walked block by block."""
    index = await redis_factory.open(IndexOptions(), lookup_budget_s=BUDGET_S)
    try:
        a, b = ENDPOINTS[:2]
        keys = [(8 << 40) + i for i in range(1000)]
        window = GroupSpec(1, GroupKind.SLIDING, 4)
        index.store(a, keys, root=keys[0])
        index.store(a, keys[300:304], root=keys[0], group=window)  # an island bisection skips
        index.store(a, keys[999:], root=keys[0], group=window)
        index.store(b, keys, root=keys[0])
        await index.flush()
        await index._client.hdel(f"{redis_factory.namespace}:b:{{{keys[0]:016x}}}", "~")
        assert (await index.lookup(keys)).matches == {a: 304.0, b: 1000.0}
    finally:
        await index.__aexit__(None, None, None)


async def test_many_runs_on_a_long_chain_are_all_found(redis_factory: IndexFactory) -> None:
    index = await redis_factory.open(IndexOptions(), lookup_budget_s=BUDGET_S)
    try:
        keys = [(9 << 40) + i for i in range(2048)]
        lengths = {ep: n for ep, n in zip(ENDPOINTS, (2048, 2047, 1024, 3, 1), strict=True)}
        for ep, n in lengths.items():
            index.record(ep, keys[:n])
        await index.flush()
        assert (await index.lookup(keys)).matches == {ep: float(n) for ep, n in lengths.items()}
        assert (await index.lookup(keys[:2])).matches == {ep: 2.0 for ep in ENDPOINTS[:4]} | {
            ENDPOINTS[4]: 1.0
        }
    finally:
        await index.__aexit__(None, None, None)
