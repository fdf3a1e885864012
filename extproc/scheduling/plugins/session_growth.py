"""What continued sessions taught: how many blocks sessions on a prefix grew past their first turn.

`bounded-sessions-filter` with `keepTogetherGrowth` leaves a new session to the scorers when
sessions on its prefix were seen to stay small (sessions.py tells why). When a session is
continued, the blocks it has grown past its first turn are kept under every
`GROUP_STRIDE`-th block key of that first turn and under each of its first `HEAD_BLOCKS`
(the most seen kept); a new session reads them back at the longest recorded prefix within
what the index holds of it.

Growth is kept in blocks, not as a fraction of the prefix it was recorded under, so it
carries from a shorter prefix to a longer one: a big tenant's next conversations arrive
before its first one's second turn (24 req/s: the biggest tenant's first 20-30 of them),
and read what conversations of other tenants, on the header every tenant shares, have
shown. Recorded under stride keys only (the sixteenth session), a header shorter than the
stride was never found: the bench's tenants share 6 approximate blocks, and 59-68 of 66-69
bounded sessions a run were bounded for want of any learned growth; hence the first blocks'
records (bench/RESULTS.md, seventeenth session). Recorded as a fraction of each prefix
(before issue 14's sixteenth session), it was read only under the tenant's own prompt,
learned from the tenant's own conversations, and the big tenants' early conversations were
bounded: the holder was still filtered out 12-15 times a run with the option on.

Learned per replica, three replicas behind one gateway each learn from the later turns they
place of sessions they started: a ninth of all, a third between them, and 45-69 of ~120 new
sessions a bench run were bounded for want of growth against 0-18 on one replica
(bench/RESULTS.md, eighteenth session). With `shareGrowth` (server/shared_growth.py, on by
default since the nineteenth session) a record that rises is published to the peers, and
the shared placements carry each session's first-turn length, so any replica placing a
later turn learns from it. It survives approximate calibration: a change of bytes per token
keeps the key geometry (calibration pins it), so the recorded keys stay the keys of the same
prefixes; only a change of block size re-keys everything (the index too), and it comes from
the first scrape, before traffic (0.85-0.96 s before it in the bench's traces).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

# Blocks between two prefixes whose growth a continued session records: a new session looks
# up the longest recorded prefix within what it shares.
GROUP_STRIDE = 8
# Recorded prefixes probed back from what a new session shares: a bounded number of dict
# lookups (2,048 shared blocks would be 256), the longest first.
_GROWTH_PROBES = 64
# Every one of a first turn's first blocks is recorded too, and probed after the stride keys:
# a header all tenants share may be shorter than the stride (the bench's tenants share 6
# approximate blocks), and under stride keys alone it was never found (bench/RESULTS.md,
# sixteenth session: 59-68 of 66-69 bounded sessions had no growth to read).
HEAD_BLOCKS = GROUP_STRIDE - 1

# (blocks grown past a first turn, the block keys it is now the most seen under): what one
# continued session taught, as replicas share it (server/shared_growth.py).
Grown = tuple[int, tuple[int, ...]]


class GrowthRecord:
    """Prefix's last block key -> the most blocks a session that started on it (its first
    turn held the prefix) grew past that first turn; least recently grown first, at most
    `max_keys` kept."""

    def __init__(self, max_keys: int) -> None:
        self._max = max_keys
        self._growth: OrderedDict[int, int] = OrderedDict()

    def learned(self, block_keys: Sequence[int], shared: int) -> tuple[int, int] | None:
        """(blocks grown past their first turn, blocks of the prefix it was read under) at
        the longest recorded prefix within the first `shared` of `block_keys`: stride keys
        from the longest down (at most `_GROWTH_PROBES`), then each of the first
        `HEAD_BLOCKS` blocks. None: nothing recorded under any of them."""
        shared = min(shared, len(block_keys))
        top = shared // GROUP_STRIDE * GROUP_STRIDE - 1
        stop = max(-1, top - _GROWTH_PROBES * GROUP_STRIDE)
        growth = self._growth
        for j in range(top, stop, -GROUP_STRIDE):
            grew = growth.get(block_keys[j])
            if grew is not None:
                return grew, j + 1
        for j in range(min(shared, HEAD_BLOCKS) - 1, -1, -1):
            grew = growth.get(block_keys[j])
            if grew is not None:
                return grew, j + 1
        return None

    def growth(self, block_keys: Sequence[int], shared: int) -> float | None:
        """How far a new session whose first turn is `block_keys`, sharing its first `shared`
        blocks, is expected to grow past them, as a fraction of `shared`: its own part of
        the first turn plus what `learned` reads. None while nothing is recorded there."""
        found = self.learned(block_keys, shared)
        if found is None:
            return None
        shared = min(shared, len(block_keys))
        return (len(block_keys) - shared + found[0]) / shared

    def record(self, grew: int, keys: Sequence[int]) -> tuple[int, ...]:
        """A session on each of `keys`' prefixes grew `grew` blocks past its first turn;
        returns the keys whose record rose (only those are news to the peers)."""
        growth = self._growth
        rose: list[int] = []
        for key in keys:
            was = growth.pop(key, -1)
            growth[key] = max(grew, was)
            if grew > was:
                rose.append(key)
        self._trim()
        return tuple(rose)

    def merge(self, grown: Grown) -> None:
        """A record a peer replica learned: each key's becomes the larger of the two."""
        grew, keys = grown
        growth = self._growth
        for key in keys:
            growth[key] = max(grew, growth.pop(key, 0))
        self._trim()

    def records(self) -> list[Grown]:
        """The whole record, one entry per figure, least recently grown first."""
        by_figure: dict[int, list[int]] = {}
        for key, grew in self._growth.items():
            by_figure.setdefault(grew, []).append(key)
        return [(grew, tuple(keys)) for grew, keys in by_figure.items()]

    def _trim(self) -> None:
        growth = self._growth
        while len(growth) > self._max:
            growth.popitem(last=False)


def record_keys(block_keys: Sequence[int], first: int) -> tuple[int, ...]:
    """The keys a session whose first turn was `first` blocks (of `block_keys`, which hold
    it) records its growth under: one per `GROUP_STRIDE` blocks of the first turn, and each
    of its first `HEAD_BLOCKS`. A turn costs first / GROUP_STRIDE + 7 dict writes, not one
    per block. Not also at the first turn's own length: growth is in blocks, and the longest
    stride key within a shared prefix is at most 7 blocks short of it."""
    end = min(first, len(block_keys))
    # Slices, not a loop per key: built for every first turn placed (a 2,048-block one holds
    # 263 keys). With learnUncontinued a new session's find + touch costs ~1.5 us more than
    # before at 64 blocks, 10-30 us at 2,048 (bench/RESULTS.md, twenty-third session).
    return (
        *block_keys[: min(end, HEAD_BLOCKS)],
        *block_keys[GROUP_STRIDE - 1 : end : GROUP_STRIDE],
    )
