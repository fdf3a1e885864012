"""Precise mode's correction by the picker's own placements (index/placed.py): blocks placed
count until the request's response, and a reported match is cut where the work placed since
will evict it; the index's own answer is never changed otherwise."""

from __future__ import annotations

from extproc.index.base import DEGRADED, Lookup
from extproc.index.placed import PlacedBlocks

A = "10.0.0.1:8000"
B = "10.0.0.2:8000"


class Clock:
    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t


def chain(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


async def test_a_placement_counts_until_its_response():
    placed = PlacedBlocks()
    keys = chain(1, 8)
    placed.placed(A, keys)
    # The engine has not published the blocks yet: the index knows nothing.
    found = await placed.adjust(keys, Lookup({}))
    assert found.matches == {A: 8}
    # Events that already show part of it: the placement's longer match wins.
    assert (await placed.adjust(keys, Lookup({A: 3.0, B: 5.0}))).matches == {A: 8, B: 5.0}
    assert placed.stats.pending == 2
    # A request sharing only the first five blocks is credited those five.
    assert (await placed.adjust((1, 2, 3, 4, 5, 99, 98), Lookup({}))).matches == {A: 5}
    placed.settled(A, keys)
    # After the response the events speak for it, whatever they say.
    assert (await placed.adjust(keys, Lookup({A: 3.0}))).matches == {A: 3.0}
    assert (await placed.adjust(keys, Lookup({}))).matches == {}


async def test_a_placement_without_response_stops_counting_after_the_bound():
    clock = Clock()
    placed = PlacedBlocks(pending_s=5.0, clock=clock)
    keys = chain(1, 8)
    placed.placed(A, keys)
    clock.t += 4.0
    assert (await placed.adjust(keys, Lookup({}))).matches == {A: 8}
    clock.t += 2.0
    assert (await placed.adjust(keys, Lookup({}))).matches == {}


async def test_a_reported_match_is_cut_to_what_the_cache_keeps_after_later_placements():
    placed = PlacedBlocks()
    placed.set_capacity(A, 10)
    first, second = chain(1, 8), chain(100, 8)
    placed.placed(A, first)
    placed.settled(A, first)
    placed.placed(A, second)  # 16 blocks placed on a 10-block cache: `first` loses its tail
    reported = Lookup({A: 8.0, B: 8.0})
    found = await placed.adjust(first, reported)
    assert found.matches == {A: 2, B: 8.0}
    assert placed.stats.evicting == 1


async def test_no_cut_without_capacity_pressure_work_in_flight_or_while_its_own_blocks_are():
    placed = PlacedBlocks()
    first, second = chain(1, 8), chain(100, 8)
    # Capacity unknown: nothing is cut.
    placed.placed(A, first)
    placed.settled(A, first)
    placed.placed(A, second)
    assert (await placed.adjust(first, Lookup({A: 8.0}))).matches == {A: 8.0}
    # Capacity known and exceeded, but the first request is still in flight there: its
    # blocks are held by it, not evictable.
    placed = PlacedBlocks()
    placed.set_capacity(A, 10)
    placed.placed(A, first)
    placed.placed(A, second)
    assert (await placed.adjust(first, Lookup({A: 8.0}))).matches == {A: 8}
    # Everything placed has ended: the events already show what it evicted.
    placed = PlacedBlocks()
    placed.set_capacity(A, 10)
    for keys in (first, second):
        placed.placed(A, keys)
        placed.settled(A, keys)
    assert (await placed.adjust(first, Lookup({A: 8.0}))).matches == {A: 8.0}
    # Room enough: nothing is cut either.
    placed = PlacedBlocks()
    placed.set_capacity(A, 100)
    placed.placed(A, first)
    placed.settled(A, first)
    placed.placed(A, second)
    assert (await placed.adjust(first, Lookup({A: 8.0}))).matches == {A: 8.0}
    assert placed.stats.evicting == 0


async def test_degraded_answers_and_forgotten_endpoints_are_left_alone():
    placed = PlacedBlocks()
    keys = chain(1, 8)
    placed.placed(A, keys)
    assert await placed.adjust(keys, DEGRADED) is DEGRADED
    await placed.forget(A)
    assert (await placed.adjust(keys, Lookup({}))).matches == {}
