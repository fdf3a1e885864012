"""WriteOrder keeps exactly the order the memory index's OrderedDict kept (by last write,
tail first within a write), through touches, discards, evictions and log compaction."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from extproc.index import recency
from extproc.index.recency import WriteOrder


class Reference:
    """The previous implementation: move every written key to the end, tail first."""

    def __init__(self) -> None:
        self.members: OrderedDict[int, None] = OrderedDict()

    def touch(self, keys: list[int]) -> None:
        for key in reversed(keys):
            self.members[key] = None
            self.members.move_to_end(key)

    def discard(self, keys: list[int]) -> None:
        for key in keys:
            self.members.pop(key, None)

    def pop_oldest(self, count: int) -> list[int]:
        count = min(count, len(self.members))
        return [self.members.popitem(last=False)[0] for _ in range(count)]


@pytest.mark.parametrize("seed", range(20))
def test_same_order_as_the_ordered_dict_it_replaces(seed: int, monkeypatch) -> None:
    # Small floors so that log filtering happens inside the test, over several writes.
    monkeypatch.setattr(recency, "_COMPACT_FLOOR", 8)
    monkeypatch.setattr(recency, "_STEP_RATIO", 1)
    monkeypatch.setattr(recency, "_STEP_FLOOR", 4)
    rng = random.Random(seed)
    ours, ref = WriteOrder(), Reference()
    universe = list(range(200))
    for _ in range(400):
        op = rng.random()
        if op < 0.6:
            start = rng.randrange(len(universe))
            keys = universe[start : start + rng.randint(1, 40)]
            ours.touch(keys)
            ref.touch(keys)
        elif op < 0.75:
            keys = rng.sample(universe, rng.randint(1, 10))
            ours.discard(keys)
            ref.discard(keys)
        else:
            n = rng.randint(0, 60)
            assert ours.pop_oldest(n) == ref.pop_oldest(n)
        assert len(ours) == len(ref.members)
        assert set(ours) == set(ref.members)
    assert ours.pop_oldest(10_000) == ref.pop_oldest(10_000)
    assert len(ours) == 0


def test_no_write_filters_more_than_a_bounded_slice_of_the_log(monkeypatch) -> None:
    """Filtering stale entries is spread over writes: a write that crosses the threshold
    filters a few times its own size, never the whole log at once."""
    filtered: list[int] = []
    real = WriteOrder._filter

    def spy(self: WriteOrder, budget: int) -> None:
        before = len(self._log)
        real(self, budget)
        filtered.append(before - len(self._log) if self._log is not None else 0)

    monkeypatch.setattr(WriteOrder, "_filter", spy)
    order = WriteOrder()
    for i in range(2000):  # 200 live keys, each written again and again: mostly stale
        order.touch(list(range(i % 20 * 10, i % 20 * 10 + 10)))
    assert len(order) == 200
    assert filtered, "the log was never filtered"
    # Budget per write: 4 x 10 keys + 256 = 296 keys = at most ~30 entries of 10 keys.
    assert max(filtered) <= 30 + 1
    assert order._logged <= recency._COMPACT_RATIO * 200 + recency._COMPACT_FLOOR + 296


def test_log_stays_proportional_to_the_keys_held(monkeypatch) -> None:
    """A hot prefix written again and again must not grow the log without bound."""
    monkeypatch.setattr(recency, "_COMPACT_FLOOR", 16)
    order = WriteOrder()
    keys = list(range(100))
    for _ in range(1000):
        order.touch(keys)
    assert len(order) == 100
    assert order._logged <= recency._COMPACT_RATIO * 100 + 16 + len(keys)
    assert order.pop_oldest(3) == [99, 98, 97]
