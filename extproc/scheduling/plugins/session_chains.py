"""Live sessions: chains of turns per endpoint, found again by their tails.

A session is recognised by its own blocks: each placed request leaves its last block keys as
the chain's tail; a later request containing one of those keys continues that chain (a next
turn holds the previous turn whole). A request containing no known tail starts a session,
though its prefix may match a shared prompt somewhere.

A continuation is looked for near the lengths the index matched (the previous turn was
recorded, or cached, up to its end, so its tail sits at the longest match or a few blocks
before it), then in the request's last few hundred blocks: a bounded number of dict probes,
not a scan of the whole request (2,048 blocks and more for a long context).

The record also feeds what sessions teach: a continued session's growth past its first turn
(session_growth.py), and the fate of each first turn, continued or not within a horizon
(session_fates.py). With a Redis index, replicas share the record (server/shared_sessions.py):
each publishes its placements and applies the others', so every replica counts every
server's sessions and finds a session's tail whichever replica placed its last turn.

When an endpoint restarts or leaves the pool, or its engine clears its prefix cache, the
sessions homed there lose their tails: they stay in the record, homeless, until their next
turn is placed (`LiveSessions.reset`). A reset is not shared between replicas: each hears of
it itself (its own scrape or a peer's shared one shows the new process start time; its own
discovery shows a departure; its own KV-event subscription the clear), and a peer's
placement made before the reset is applied homeless.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from extproc.scheduling.plugins.session_classes import UNKNOWN_CLASS
from extproc.scheduling.plugins.session_fates import FirstTurnFates, Waiting
from extproc.scheduling.plugins.session_growth import Grown, GrowthRecord, record_keys

# Tail keys kept per chain: the last full block of a turn is normally inside the next turn,
# but a template may rewrite the last block when the assistant's answer follows it.
_TAIL_KEYS = 2
# Blocks probed back from a matched length: with precise keys the engine also caches the
# previous answer, so the match runs past the previous prompt's tail by that answer's blocks.
_PROBE_BACK = 64
# Blocks scanned back from a request's end when no match length leads to a tail: a turn
# adds fewer (a tool result, a user message), a new session pays this much, not its length.
_SCAN_TAIL = 256

# (previous tail keys or (), endpoint, new tail keys, blocks of the session's first turn or
# 0 if not known, the first turn's class or UNKNOWN_CLASS): one placement, as replicas
# share it.
Touch = tuple[tuple[int, ...], str, tuple[int, ...], int, str]


@dataclass(slots=True)
class _Chain:
    # None: homeless, its endpoint restarted or left (`LiveSessions.reset`).
    endpoint: str | None
    seen: float
    keys: tuple[int, ...]
    # Blocks of the session's first turn: 0 when not known (another replica placed it).
    first: int = 0
    # Turns placed in the chain (1: its first turn only, not continued yet).
    turns: int = 1
    # The first turn's class (session_classes.py): whose prior its fate counts in.
    cls: str = UNKNOWN_CLASS


class LiveSessions:
    """Chains of requests per endpoint, active within the last `window_s` seconds; at most
    `max_sessions` are remembered (the least recently active are forgotten first). With
    `learn_growth`, what continued sessions grew (session_growth.py); with
    `learn_uncontinued` as well, first turns' fates (session_fates.py)."""

    def __init__(
        self,
        window_s: float,
        max_sessions: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        learn_growth: bool = False,
        share_growth: bool = False,
        learn_uncontinued: bool = False,
        uncontinued_prior: bool = False,
        uncontinued_floor_s: float = 2.0,
        uncontinued_cap_s: float = 60.0,
    ) -> None:
        self._window = window_s
        self._learn = learn_growth
        self._share = learn_growth and share_growth
        self._max = max_sessions
        self._clock = clock
        self._chains: OrderedDict[int, _Chain] = OrderedDict()  # least recently active first
        self._by_key: dict[int, int] = {}  # tail key -> chain id
        self._counts: dict[str, int] = {}
        # Endpoint -> when it was last reset (this clock): a peer's placement there made
        # before it is applied homeless.
        self._reset_at: dict[str, float] = {}
        self._next_id = 0
        self._uncontinued = learn_growth and learn_uncontinued
        self._growth = GrowthRecord(max_sessions)
        # A chain is forgotten after `window_s` idle: a horizon past it could never see the
        # first turn again.
        self._fates = FirstTurnFates(
            max_sessions,
            enabled=self._uncontinued,
            prior=uncontinued_prior,
            floor_s=uncontinued_floor_s,
            cap_s=min(uncontinued_cap_s, window_s),
        )
        # Called with each placement made here (replicas publish it, see shared_sessions).
        self.on_touch: Callable[[Touch], None] | None = None
        # Called with each growth record that rose here (replicas publish it with
        # `share_growth`, see shared_growth).
        self.on_grown: Callable[[Grown], None] | None = None

    def __len__(self) -> int:
        return len(self._chains)

    @property
    def window_s(self) -> float:
        return self._window

    @property
    def shares_growth(self) -> bool:
        """Whether learned growth is shared with the peer replicas (and peers' placements
        carry their sessions' first-turn lengths into this record)."""
        return self._share

    @property
    def learns_uncontinued(self) -> bool:
        """Whether first turns nothing continued are recorded as grown 0 blocks."""
        return self._fates.enabled

    @property
    def uncontinued_learned(self) -> int:
        """First turns recorded as not continued."""
        return self._fates.learned

    @property
    def uncontinued_untracked(self) -> int:
        """First turns not watched for want of room (they teach nothing)."""
        return self._fates.untracked

    @property
    def unclassed_continued(self) -> int:
        """First turns continued whose class was not known (a peer that does not send it):
        each counted as come back for every class."""
        return self._fates.unclassed

    def sessions_come_back(self, cls: str = UNKNOWN_CLASS) -> bool | None:
        """The fleet's prior for a prefix nothing is recorded under (`uncontinued_prior`),
        for first turns of class `cls`: False while the class's last `_OUTCOMES` first turns
        with a known fate (at least `_PRIOR_MIN`) all went uncontinued; True once one of
        them was continued; None: not known yet, or the option off."""
        return self._fates.come_back(cls)

    def uncontinued_horizon(self) -> float | None:
        """Seconds after which a first turn no later turn continued is recorded as grown 0
        blocks: `_GAP_MULTIPLE` x the longest recent first-to-second-turn gap, within the
        floor and cap. None: not learned (`learn_uncontinued` off)."""
        return self._fates.horizon()

    def settle(self, now: float | None = None) -> None:
        """Records the first turns whose horizon has passed without a later turn (with
        `learn_uncontinued`): each grew 0 blocks past itself. A dict probe per call while
        none is due."""
        fates = self._fates
        if not fates.waiting:
            return
        chains = self._chains
        for turn in fates.due(self._clock() if now is None else now):
            # Continued (re-placed as a new _Chain), or forgotten (idle past the window, the
            # record full, the same prompt placed again): nothing to learn from it here.
            chain = chains.get(turn.chain_id)
            if chain is not None and chain is turn.placed:
                fates.uncontinued(chain.cls)
                self._record(0, turn.keys)
                # It still counts among its server's live sessions for the window: the bound
                # is relative, and old one-shot turns spread evenly over the fleet loosen it.
                # Uncounted, only the last horizon's first turns were counted, mostly on the
                # holders of the groups then arriving, and more holders were removed (text at
                # 16 req/s: 13 against 4 and 10, hit ratio 51-54% against 59-66%;
                # bench/RESULTS.md, twenty-third session, oneshot2).

    def find(self, block_keys: Sequence[int], matched: Iterable[float] = ()) -> int | None:
        """The live chain this request continues, or None (a new session). `matched`: the
        blocks each endpoint holds of the request (the index's answer); the previous turn's
        tail is probed at and up to `_PROBE_BACK` blocks before each distinct match length,
        longest first, then in the request's last `_SCAN_TAIL` blocks (a shared index may
        not show the previous turn yet: another replica's write still on its way)."""
        by_key = self._by_key
        n = len(block_keys)
        if not by_key or not n:
            return None
        # Tier weights make a match fractional: round up, the probe walks back anyway.
        ends = sorted({min(n, math.ceil(m)) for m in matched if m > 0}, reverse=True)
        # At most `_PROBE_BACK` per match length plus `_SCAN_TAIL` dict lookups, whatever the
        # prompt's length: a long new prompt must not cost a loop per key (a window
        # may overlap another: probing a key twice is cheaper than tracking what was done).
        windows = [(end - 1, max(0, end - _PROBE_BACK) - 1) for end in ends]
        windows.append((n - 1, max(0, n - _SCAN_TAIL) - 1))
        for top, stop in windows:
            for i in range(top, stop, -1):
                chain = by_key.get(block_keys[i])
                if chain is not None:
                    return chain
        return None

    def endpoint(self, chain_id: int) -> str | None:
        """Where the chain's last turn was placed (its tail grew there); None for a chain
        forgotten, or homeless since its endpoint was reset (`reset`)."""
        chain = self._chains.get(chain_id)
        return chain.endpoint if chain is not None else None

    def growth(self, block_keys: Sequence[int], shared: int) -> float | None:
        """How far a new session whose first turn is `block_keys`, sharing its first `shared`
        blocks, is expected to grow past them, as a fraction of `shared`: its own part of
        the first turn plus the most blocks sessions that started on the same prefix grew
        past their first turns (read at the longest recorded prefix within `shared`).
        None while no session on any of those prefixes has been continued here."""
        return self._growth.growth(block_keys, shared)

    def learned(self, block_keys: Sequence[int], shared: int) -> tuple[int, int] | None:
        """(blocks grown past their first turn, blocks of the prefix it was read under) at
        the longest recorded prefix within the first `shared` of `block_keys`
        (`GrowthRecord.learned`). None: nothing recorded under any of them."""
        return self._growth.learned(block_keys, shared)

    def counts(self) -> Mapping[str, int]:
        """Live sessions per endpoint (endpoints without any are absent; homeless sessions
        count on none)."""
        self._expire(self._clock())
        return self._counts

    def reset(self, endpoint: str) -> int:
        """`endpoint` restarted or left the pool, or its engine cleared its prefix cache:
        its cache went, and with it the tail of every session homed there. Those sessions
        stay in the record but homeless: counted on no endpoint (an emptied server carries
        none of them, and a new session must not be kept off it for them), `endpoint()`
        None (nothing to keep a later turn home for). Their chains stay findable, so a
        later turn still continues its session: its first-turn length, class and turn count
        are the client's, not the server's, and what it grows past its first turn is learned
        as before (growth records are kept per prefix, not per endpoint, and stay valid
        too). The turn's placement re-homes the chain. Returns how many sessions were homed
        there.

        A scan of the whole record (50,000 chains at most, a few ms): resets are rare (a
        restart, a scale-down, a cache cleared), a per-endpoint index would cost every
        placement."""
        now = self._clock()
        self._reset_at[endpoint] = now
        # Past the window every placement before a reset has expired anyway.
        horizon = now - self._window
        for address in [a for a, at in self._reset_at.items() if at < horizon]:
            del self._reset_at[address]
        n = self._counts.pop(endpoint, 0)
        if n:
            for chain in self._chains.values():
                if chain.endpoint == endpoint:
                    chain.endpoint = None
        return n

    def touch(
        self,
        chain_id: int | None,
        endpoint: str,
        block_keys: Sequence[int],
        cls: str = UNKNOWN_CLASS,
    ) -> None:
        """`block_keys` were placed on `endpoint`, continuing `chain_id` (None: a new one
        of class `cls`, session_classes.py; a continuation keeps its first turn's)."""
        if not block_keys:
            return
        old = self._chains.get(chain_id) if chain_id is not None else None
        tail = tuple(block_keys[-_TAIL_KEYS:])
        first = len(block_keys)
        now = self._clock()
        if old is not None:
            first = old.first
            cls = old.cls
            if first and self._learn:
                self._record(max(0, len(block_keys) - first), record_keys(block_keys, first))
        placed = self._place(chain_id, endpoint, tail, now, first, cls)
        if old is None and self._uncontinued:
            keys = record_keys(block_keys, len(block_keys))
            self._fates.wait(Waiting(now, placed, self._chains.get(placed), keys))
        self.settle(now)
        if self.on_touch is not None:
            self.on_touch((old.keys if old is not None else (), endpoint, tail, first, cls))

    def apply(self, touch: Touch, age_s: float = 0.0) -> None:
        """A placement another replica made `age_s` ago: continues the chain ending on its
        previous tail keys (if still live here), as `touch` does. With `share_growth`, the
        session's first-turn length comes along when this record does not know it, so a
        later turn placed here learns growth (else only the replica that placed the first
        turn learns, from the third of the later turns it places with three replicas)."""
        prev, endpoint, tail, peer_first, peer_cls = touch
        if not tail:
            return
        chain_id = next((c for k in prev if (c := self._by_key.get(k)) is not None), None)
        old = self._chains.get(chain_id) if chain_id is not None else None
        first = old.first if old is not None else 0
        if not first and self._share:
            first = peer_first
        # The chain's class as this record knows it, else as the peer sent it.
        cls = old.cls if old is not None and old.cls != UNKNOWN_CLASS else peer_cls
        at = self._clock() - max(0.0, age_s)
        # Made before this record heard its endpoint reset, read after (a peer's batch on its
        # way, or behind a slow read): that tail went with the old cache. A placement queued
        # through a Redis outage is timed by its late publication and cannot be told apart.
        home = None if at < self._reset_at.get(endpoint, -math.inf) else endpoint
        self._place(chain_id, home, tail, at, first, cls)

    def merge_growth(self, grown: Grown) -> None:
        """A growth record a peer replica learned: each key's record becomes the larger of
        the two (as its own continued sessions would have made it). The caller checks the
        figures (server/shared_growth.py); the record stays within `max_sessions` keys."""
        self._growth.merge(grown)

    def growth_records(self) -> list[Grown]:
        """The growth learned here (own and merged), one record per figure, least recently
        grown first: to publish again where the shared copy was lost (an emptied snapshot,
        server/shared_growth.py)."""
        return self._growth.records()

    def _record(self, grew: int, keys: Sequence[int]) -> None:
        rose = self._growth.record(grew, keys)
        # Only what rose goes to the peers: a record already at its most costs no traffic
        # (a big tenant's header records stop changing after its first few sessions).
        if rose and self._share and self.on_grown is not None:
            self.on_grown((grew, rose))

    def _place(
        self,
        chain_id: int | None,
        endpoint: str | None,
        tail: tuple[int, ...],
        now: float,
        first: int = 0,
        cls: str = UNKNOWN_CLASS,
    ) -> int:
        """Places the chain's newest turn (a new chain when `chain_id` is None or forgotten);
        returns its id (`endpoint` None: homeless, counted nowhere). A chain continued after
        its first turn adds a first-to-second-turn gap, and a continued first turn to its
        class's fates."""
        turns = 1
        if chain_id is not None and (old := self._chains.pop(chain_id, None)) is not None:
            self._forget(old)
            turns = old.turns + 1
            if old.turns == 1:
                self._fates.continued(cls, max(0.0, now - old.seen))
        else:
            chain_id = self._next_id
            self._next_id += 1
        chain = _Chain(endpoint, now, tail, first, turns, cls)
        self._chains[chain_id] = chain
        for key in chain.keys:
            prev = self._by_key.get(key)
            if prev is not None and prev != chain_id and (other := self._chains.get(prev)):
                # Another chain ended on the same block (the same prompt sent twice): the
                # newest placement is where a continuation will look for it.
                self._chains.pop(prev)
                self._forget(other)
            self._by_key[key] = chain_id
        if endpoint is not None:
            self._counts[endpoint] = self._counts.get(endpoint, 0) + 1
        self._expire(now)
        return chain_id

    def _expire(self, now: float) -> None:
        chains = self._chains
        horizon = now - self._window
        while chains:
            chain = next(iter(chains.values()))
            if chain.seen >= horizon and len(chains) <= self._max:
                break
            chains.popitem(last=False)
            self._forget(chain)

    def _forget(self, chain: _Chain) -> None:
        for key in chain.keys:
            self._by_key.pop(key, None)
        if chain.endpoint is None:
            return
        n = self._counts.get(chain.endpoint, 0) - 1
        if n > 0:
            self._counts[chain.endpoint] = n
        else:
            self._counts.pop(chain.endpoint, None)
