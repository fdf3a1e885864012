"""Live sessions per endpoint, and a bound on them for placing new sessions.

Agentic and chat sessions are idle between turns (a tool runs, a user types), so in-flight
counts barely see them: when a new session arrives, the server holding the shared agent
prompt looks idle and predicted TTFT sends it there, and the next, and the next. Their tails
then grow past that server's KV capacity and sessions get moved mid-way, each move
recomputing a long tail. What a server really carries is its live sessions: chains of turns
that will come back and keep growing there.

A session is recognised by its own blocks: each placed request leaves its last block keys as
the chain's tail; a later request containing one of those keys continues that chain (a next
turn holds the previous turn whole). A request containing no known tail starts a session,
though its prefix may match a shared prompt somewhere.

`BoundedSessionsFilter` applies consistent hashing with bounded loads to new sessions only: an
endpoint may take a new session while its live sessions stay within `(1 + epsilon)` times its
share (by KV capacity) of all live sessions. The hot shared prefix is thereby replicated on
more servers, deliberately and early, and each session's later turns are left to the
scorers (its tail pulls it back where it grew). Continuations are never filtered.

A continuation is looked for near the lengths the index matched (the previous turn was
recorded, or cached, up to its end, so its tail sits at the longest match or a few blocks
before it), then in the request's last few hundred blocks: a bounded number of dict probes,
not a scan of the whole request (2,048 blocks and more for a long context).

Optionally (`keepTogetherGrowth`), the bound is only for sessions that grow. A chat
tenant's new conversation is also a new session on a known prefix (the tenant's prompt),
but it ends after a turn or two having added a fraction of what it shares: bounding it
only wrote big tenants' prompts onto five or six servers (issue 14, tenants: the holder
filtered out in 13-28 requests a run). So a new session is looked up in what continued
sessions have taught: when a session is continued, how many blocks it has grown past its
first turn is kept under every `_GROUP_STRIDE`-th block key of that first turn and under
each of its first blocks (the most seen); a new session reads it back at the longest
recorded prefix within what the index holds of it, and expects to end that far past its own
first turn. One whose expected part of its own (its first turn past the shared prefix, plus
that growth) stays within `keepTogetherGrowth` of the shared prefix is left to the scorers;
one on a prefix no session has been seen continued on is bounded (an agentic first fill
shows nothing before the bound must act).

The price of that last rule falls on one-shot prefix groups: prompts that share a system
prompt and images but are never continued (bench_routing's multimodal and text workloads).
Every repeat of such a group is a new session of unknown growth, and nothing is ever learned
for it, so each is bounded: on multimodal at 6 req/s, 12-15 of 48 repeats had every holder
removed and wrote the group's prefix on another server (hit ratio 68-77% of the oracle
against 88-93% with the bound off; bench/RESULTS.md, twenty-second session). No request tells such a
repeat from an agent's second session on a new prompt (tests/e2e/test_session_spread.py
sends exactly that); only what comes later does.

So, optionally (`learnUncontinued`), what comes later is read: a first turn that no later
turn continued within a horizon grew 0 blocks past itself, and is recorded as a continued
session's growth would be (under the same keys, the most seen kept: one agent session on
the prefix that does continue, before or after, keeps its group bounded). The horizon is
measured, not set: a multiple of the longest of the recent first-to-second-turn gaps the
picker saw (a session's next turn comes after its answer and the client's think or tool
time, which continued sessions show), never under a floor (no gap seen yet: the first
sessions of a fleet whose sessions come back slowly) nor over a cap (within the window a
chain is remembered). A wrong call costs only the new sessions placed before the late turn
arrives: that turn records its real growth, and the group is bounded again.

That still bounds a group's repeats until its own first request's horizon has passed (the
first 2 s of each group: 8-19 of 48 repeats at 6 req/s on bench_routing's multimodal). With
`uncontinuedPrior` as well, the fleet's outcomes for the request's class stand in for a
group's own: while the last `_OUTCOMES` first turns of its class (API, tools declared, media:
session_classes.py) whose fate is known (at least `_PRIOR_MIN`) all went uncontinued, no
session of the class anywhere having come back, a new session on a prefix with nothing
recorded is expected to grow 0 blocks too. One first turn of the class continued, anywhere in
the fleet (a peer's placement counts, its class travelling with it), ends it until
`_OUTCOMES` more go uncontinued; and a prefix whose sessions were seen to grow is read as
before, so it only decides prefixes the record knows nothing of. Kept for the whole fleet,
one-shot outcomes spoke for agents starting on a new prompt (twenty-fourth session: their
TTFT p90 worse in 8 of 8 pairs); agents that declare tools are a class of their own.

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
bounded: the holder was still filtered out 12-15 times a run with the option on. Learned
per replica, three replicas behind one gateway each learn from the later turns they place
of sessions they started: a ninth of all, a third between them, and 45-69 of ~120 new
sessions a bench run were bounded for want of growth against 0-18 on one replica
(bench/RESULTS.md, eighteenth session). With `shareGrowth` (server/shared_growth.py, on by
default since the nineteenth session) a record that rises is published to the peers, and
the shared placements carry each session's first-turn length, so any replica placing a
later turn learns from it. It survives
approximate calibration: a change of bytes per token keeps the key geometry (calibration
pins it), so the recorded keys stay the keys of the same prefixes; only a change of block
size re-keys everything (the index too), and it comes from the first scrape, before traffic
(0.85-0.96 s before it in the bench's traces).

With a Redis index, replicas share the record (server/shared_sessions.py): each publishes
its placements and applies the others', so every replica counts every server's sessions and
finds a session's tail whichever replica placed its last turn.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Annotated, ClassVar

import msgspec

from extproc.core import Candidate, Decision, InferenceRequest
from extproc.errors import ConfigError
from extproc.scheduling.plugins.session_classes import (
    UNKNOWN_CLASS,
    ClassOutcomes,
    session_class,
)

log = logging.getLogger(__name__)

# Tail keys kept per chain: the last full block of a turn is normally inside the next turn,
# but a template may rewrite the last block when the assistant's answer follows it.
_TAIL_KEYS = 2
# Blocks probed back from a matched length: with precise keys the engine also caches the
# previous answer, so the match runs past the previous prompt's tail by that answer's blocks.
_PROBE_BACK = 64
# Blocks scanned back from a request's end when no match length leads to a tail: a turn
# adds fewer (a tool result, a user message), a new session pays this much, not its length.
_SCAN_TAIL = 256

# Blocks between two prefixes whose growth a continued session records: a new session looks
# up the longest recorded prefix within what it shares.
_GROUP_STRIDE = 8
# Recorded prefixes probed back from what a new session shares: a bounded number of dict
# lookups (2,048 shared blocks would be 256), the longest first.
_GROWTH_PROBES = 64
# Every one of a first turn's first blocks is recorded too, and probed after the stride keys:
# a header all tenants share may be shorter than the stride (the bench's tenants share 6
# approximate blocks), and under stride keys alone it was never found (bench/RESULTS.md,
# sixteenth session: 59-68 of 66-69 bounded sessions had no growth to read).
_HEAD_BLOCKS = _GROUP_STRIDE - 1

# A first turn counts as not continued once it waited this many times the longest recent
# first-to-second-turn gap: think and tool times vary (a slow tool, a queued prefill), and
# 4x the longest of the last `_GAPS` leaves a session that is merely slow a wide margin,
# while a wrong call is undone by the late turn itself (its growth outranks the 0).
_GAP_MULTIPLE = 4.0
# First-to-second-turn gaps remembered (the most recent): the horizon follows the fleet's
# current clients, not one slow session of an hour ago.
_GAPS = 32
# First turns of a class whose fate (continued, or not within the horizon) makes the class's
# prior, the most recent: one continued among them and new prefixes are bounded as before.
_OUTCOMES = 32
# Fates of a class known before the prior says anything for it (bounded as before).
_PRIOR_MIN = 8
# Block keys held for first turns waiting for their horizon (each keeps its record keys:
# one per `_GROUP_STRIDE` blocks and its first `_HEAD_BLOCKS`, 263 for 2,048 blocks): at
# ~45 bytes a key, 12 MiB at most, whatever the request rate and prompt lengths. Past it a
# first turn is not tracked (counted, and said in a log line).
_PENDING_KEYS = 1 << 18

# (previous tail keys or (), endpoint, new tail keys, blocks of the session's first turn or
# 0 if not known, the first turn's class or UNKNOWN_CLASS): one placement, as replicas
# share it.
Touch = tuple[tuple[int, ...], str, tuple[int, ...], int, str]
# (blocks grown past a first turn, the block keys it is now the most seen under): what one
# continued session taught, as replicas share it (server/shared_growth.py).
Grown = tuple[int, tuple[int, ...]]


@dataclass(slots=True)
class _Chain:
    endpoint: str
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
    `max_sessions` are remembered (the least recently active are forgotten first)."""

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
        self._uncontinued = learn_growth and learn_uncontinued
        self._prior = self._uncontinued and uncontinued_prior
        # A chain is forgotten after `window_s` idle: a horizon past it could never see the
        # first turn again.
        self._cap = min(uncontinued_cap_s, window_s)
        self._floor = min(uncontinued_floor_s, self._cap)
        self._share = learn_growth and share_growth
        self._max = max_sessions
        self._clock = clock
        self._chains: OrderedDict[int, _Chain] = OrderedDict()  # least recently active first
        self._by_key: dict[int, int] = {}  # tail key -> chain id
        self._counts: dict[str, int] = {}
        # prefix's last block key -> the most blocks a session that started on it (its first
        # turn held the prefix) grew past that first turn; least recently grown first, at
        # most `max_sessions` kept.
        self._growth: OrderedDict[int, int] = OrderedDict()
        self._next_id = 0
        # First turns placed here waiting for their horizon, oldest first: (placed at, chain
        # id, the chain as placed, the keys its growth is recorded under); `_pending_keys`
        # keys in all.
        self._pending: deque[tuple[float, int, _Chain, tuple[int, ...]]] = deque()
        self._pending_keys = 0
        # The most recent first-to-second-turn gaps (seconds), here or at a peer.
        self._gaps: deque[float] = deque(maxlen=_GAPS)
        # The most recent first turns' fates per class: continued, or not within the horizon.
        self._outcomes = ClassOutcomes(_OUTCOMES, _PRIOR_MIN)
        # First turns recorded as not continued, and first turns not tracked for want of room.
        self.uncontinued_learned = 0
        self.uncontinued_untracked = 0
        # First turns continued whose class was not known (a peer that does not send it):
        # each counted as come back for every class.
        self.unclassed_continued = 0
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
        return self._uncontinued

    def sessions_come_back(self, cls: str = UNKNOWN_CLASS) -> bool | None:
        """The fleet's prior for a prefix nothing is recorded under (`uncontinued_prior`),
        for first turns of class `cls`: False while the class's last `_OUTCOMES` first turns
        with a known fate (at least `_PRIOR_MIN`) all went uncontinued; True once one of
        them was continued; None: not known yet, or the option off."""
        if not self._prior:
            return None
        return self._outcomes.come_back(cls)

    def uncontinued_horizon(self) -> float | None:
        """Seconds after which a first turn no later turn continued is recorded as grown 0
        blocks: `_GAP_MULTIPLE` x the longest recent first-to-second-turn gap, within the
        floor and cap. None: not learned (`learn_uncontinued` off)."""
        if not self._uncontinued:
            return None
        gaps = self._gaps
        seen = _GAP_MULTIPLE * max(gaps) if gaps else 0.0
        return min(self._cap, max(self._floor, seen))

    def settle(self, now: float | None = None) -> None:
        """Records the first turns whose horizon has passed without a later turn (with
        `learn_uncontinued`): each grew 0 blocks past itself. A dict probe per call while
        none is due."""
        pending = self._pending
        if not pending:
            return
        now = self._clock() if now is None else now
        due = now - (self.uncontinued_horizon() or 0.0)
        chains = self._chains
        while pending and pending[0][0] <= due:
            _, chain_id, chain, keys = pending.popleft()
            self._pending_keys -= len(keys)
            # Continued (re-placed as a new _Chain), or forgotten (idle past the window, the
            # record full, the same prompt placed again): nothing to learn from it here.
            if chains.get(chain_id) is chain:
                self.uncontinued_learned += 1
                self._outcomes.add(chain.cls, False)
                self._record(0, keys)
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
        """Where the chain's last turn was placed (its tail grew there)."""
        chain = self._chains.get(chain_id)
        return chain.endpoint if chain is not None else None

    def growth(self, block_keys: Sequence[int], shared: int) -> float | None:
        """How far a new session whose first turn is `block_keys`, sharing its first `shared`
        blocks, is expected to grow past them, as a fraction of `shared`: its own part of
        the first turn plus the most blocks sessions that started on the same prefix grew
        past their first turns (read at the longest recorded prefix within `shared`).
        None while no session on any of those prefixes has been continued here."""
        found = self.learned(block_keys, shared)
        if found is None:
            return None
        shared = min(shared, len(block_keys))
        return (len(block_keys) - shared + found[0]) / shared

    def learned(self, block_keys: Sequence[int], shared: int) -> tuple[int, int] | None:
        """(blocks grown past their first turn, blocks of the prefix it was read under) at
        the longest recorded prefix within the first `shared` of `block_keys`: stride keys
        from the longest down (at most `_GROWTH_PROBES`), then each of the first
        `_HEAD_BLOCKS` blocks. None: nothing recorded under any of them."""
        shared = min(shared, len(block_keys))
        top = shared // _GROUP_STRIDE * _GROUP_STRIDE - 1
        stop = max(-1, top - _GROWTH_PROBES * _GROUP_STRIDE)
        growth = self._growth
        for j in range(top, stop, -_GROUP_STRIDE):
            grew = growth.get(block_keys[j])
            if grew is not None:
                return grew, j + 1
        for j in range(min(shared, _HEAD_BLOCKS) - 1, -1, -1):
            grew = growth.get(block_keys[j])
            if grew is not None:
                return grew, j + 1
        return None

    def counts(self) -> Mapping[str, int]:
        """Live sessions per endpoint (endpoints without any are absent)."""
        self._expire(self._clock())
        return self._counts

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
                self._record(max(0, len(block_keys) - first), _record_keys(block_keys, first))
        placed = self._place(chain_id, endpoint, tail, now, first, cls)
        if old is None and self._uncontinued:
            self._wait_for_next_turn(now, placed, block_keys)
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
        self._place(chain_id, endpoint, tail, self._clock() - max(0.0, age_s), first, cls)

    def merge_growth(self, grown: Grown) -> None:
        """A growth record a peer replica learned: each key's record becomes the larger of
        the two (as its own continued sessions would have made it). The caller checks the
        figures (server/shared_growth.py); the record stays within `max_sessions` keys."""
        grew, keys = grown
        growth = self._growth
        for key in keys:
            growth[key] = max(grew, growth.pop(key, 0))
        while len(growth) > self._max:
            growth.popitem(last=False)

    def growth_records(self) -> list[Grown]:
        """The growth learned here (own and merged), one record per figure, least recently
        grown first: to publish again where the shared copy was lost (an emptied snapshot,
        server/shared_growth.py)."""
        by_figure: dict[int, list[int]] = {}
        for key, grew in self._growth.items():
            by_figure.setdefault(grew, []).append(key)
        return [(grew, tuple(keys)) for grew, keys in by_figure.items()]

    def _wait_for_next_turn(self, now: float, chain_id: int, block_keys: Sequence[int]) -> None:
        keys = _record_keys(block_keys, len(block_keys))
        if len(self._pending) >= self._max or self._pending_keys + len(keys) > _PENDING_KEYS:
            # First turns arriving faster than their horizon lets them go: this one will
            # teach nothing if it is not continued (its group stays bounded, as without
            # the option).
            self.uncontinued_untracked += 1
            if self.uncontinued_untracked & (self.uncontinued_untracked - 1) == 0:
                log.warning(
                    "bounded-sessions-filter: %d first turns not tracked for continuation "
                    "(%d waiting, %d keys); one-shot groups among them stay bounded",
                    self.uncontinued_untracked,
                    len(self._pending),
                    self._pending_keys,
                )
            return
        chain = self._chains.get(chain_id)
        if chain is not None:
            self._pending.append((now, chain_id, chain, keys))
            self._pending_keys += len(keys)

    def _unclassed(self) -> None:
        self.unclassed_continued += 1
        n = self.unclassed_continued
        if self._prior and n & (n - 1) == 0:
            log.warning(
                "bounded-sessions-filter: %d continued sessions of no known class (a peer "
                "replica that does not send it); each ends uncontinuedPrior for every class",
                n,
            )

    def _record(self, grew: int, keys: Sequence[int]) -> None:
        growth = self._growth
        rose: list[int] = []
        for key in keys:
            was = growth.pop(key, -1)
            growth[key] = max(grew, was)
            if grew > was:
                rose.append(key)
        while len(growth) > self._max:
            growth.popitem(last=False)
        # Only what rose goes to the peers: a record already at its most costs no traffic
        # (a big tenant's header records stop changing after its first few sessions).
        if rose and self._share and self.on_grown is not None:
            self.on_grown((grew, tuple(rose)))

    def _place(
        self,
        chain_id: int | None,
        endpoint: str,
        tail: tuple[int, ...],
        now: float,
        first: int = 0,
        cls: str = UNKNOWN_CLASS,
    ) -> int:
        """Places the chain's newest turn (a new chain when `chain_id` is None or forgotten);
        returns its id. A chain continued after its first turn adds a first-to-second-turn
        gap, and a continued first turn to its class's fates."""
        turns = 1
        if chain_id is not None and (old := self._chains.pop(chain_id, None)) is not None:
            self._forget(old)
            turns = old.turns + 1
            if old.turns == 1:
                self._gaps.append(max(0.0, now - old.seen))
                self._outcomes.add(cls, True)
                if cls == UNKNOWN_CLASS:
                    self._unclassed()
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
        n = self._counts.get(chain.endpoint, 0) - 1
        if n > 0:
            self._counts[chain.endpoint] = n
        else:
            self._counts.pop(chain.endpoint, None)


def _record_keys(block_keys: Sequence[int], first: int) -> tuple[int, ...]:
    """The keys a session whose first turn was `first` blocks (of `block_keys`, which hold
    it) records its growth under: one per `_GROUP_STRIDE` blocks of the first turn, and each
    of its first `_HEAD_BLOCKS`. A turn costs first / _GROUP_STRIDE + 7 dict writes, not one
    per block. Not also at the first turn's own length: growth is in blocks, and the longest
    stride key within a shared prefix is at most 7 blocks short of it."""
    end = min(first, len(block_keys))
    # Slices, not a loop per key: built for every first turn placed (a 2,048-block one holds
    # 263 keys). With learnUncontinued a new session's find + touch costs ~1.5 us more than
    # before at 64 blocks, 10-30 us at 2,048 (bench/RESULTS.md, twenty-third session).
    return (
        *block_keys[: min(end, _HEAD_BLOCKS)],
        *block_keys[_GROUP_STRIDE - 1 : end : _GROUP_STRIDE],
    )


def session_bound(fair: float, epsilon: float) -> int:
    """The most sessions an endpoint whose fair share is `fair` sessions may carry: the
    largest whole number within `(1 + epsilon) x fair`, and never under `ceil(fair)` (the
    bounds then sum to at least the sessions placed, so some endpoint always has room).

    Rounding the tolerance up instead, `ceil((1 + epsilon) x fair)`, lets it exceed epsilon
    many times over while sessions are few: at one session's share per server a bound of 2
    is +100%, not +25%, and the server holding the shared prompt took a second and a third
    session while another server had none and kept none (issue 14, agentic: 8 sessions on 4
    servers ended 3/3/2/0 at the start, spreads like 34/30/25/7 requests)."""
    # The small tolerance keeps float error from shaving a whole session off a bound.
    return max(math.ceil(fair - 1e-9), math.floor((1.0 + epsilon) * fair + 1e-9))


@dataclass(slots=True)
class SessionBoundStats:
    """What `bounded-sessions-filter` did with requests that start a session on a known
    prefix: `bounded` (the bound applied), `kept_together` (left to the scorers: sessions
    on the prefix were seen to stay small), `growth_unknown` (bounded because no session on
    the prefix had been seen continued: the learned signal missing, with
    `keepTogetherGrowth` on), `holders_removed` (bounded, and every endpoint holding the
    most of the prefix was removed: the session's prompt is written elsewhere),
    `header_growth` (kept together or bounded on growth read under one of the prefix's first
    `_HEAD_BLOCKS` blocks: a header wider than the session's own prompt, the coarsest
    fallback). With `learnUncontinued`: `uncontinued_learned` (first turns recorded as grown
    0 blocks, no later turn having come within the horizon), `uncontinued_untracked` (first
    turns not watched for want of room: they teach nothing), and `uncontinued_horizon_s`
    (the horizon now, seconds); with `uncontinuedPrior`, `uncontinued_prior` (new sessions
    on a prefix nothing was recorded under, kept together because no first turn in the
    fleet's recent ones came back) and `uncontinued_unclassed` (first turns continued whose
    class a peer replica did not send: each ends the prior for every class)."""

    bounded: int = 0
    kept_together: int = 0
    growth_unknown: int = 0
    holders_removed: int = 0
    header_growth: int = 0
    uncontinued_learned: int = 0
    uncontinued_untracked: int = 0
    uncontinued_horizon_s: float = 0.0
    uncontinued_prior: int = 0
    uncontinued_unclassed: int = 0


def _capacity(c: Candidate) -> float | None:
    st = c.state
    if st.kv_blocks and st.kv_block_size:
        return float(st.kv_blocks * st.kv_block_size)
    return None


class BoundedSessionsFilter:
    """For a request that starts a session on a known prefix (it continues no live chain of
    turns, and some endpoint holds part of it, a shared prompt or header, or the index could
    not say), keeps the endpoints whose live sessions, with this one, stay within
    `(1 + epsilon) x (live sessions + 1) x their share of the fleet's KV capacity` (equal
    shares while any capacity is unknown), rounded down but never below the share itself
    rounded up (`session_bound`). A session's later turns pass unfiltered. Never removes
    every candidate.

    With `keepTogetherGrowth` above 0 (0.5 by default), unbounded: a new session expected
    to end at most that many times the shared prefix's length past it (what the index holds
    of it): its first turn's own part, plus the most blocks sessions that started on the
    same prefix, or the longest recorded part of it, grew past their first turns. Measured
    on bench/bench_routing.py's workloads (sim tokenizer, 16-token blocks): a chat tenant's
    conversation ends 0.18-0.20 past its ~139 shared blocks; an agent session is 0.64 past
    its 182 after one tool turn, 1.2 after two: 0.5 sits between. 0 bounds every new
    session on a known prefix (the default before issue 14's sixteenth session; see
    bench/RESULTS.md for both).

    With `shareGrowth` (the default) and a Redis index, replicas share what they learn (see
    the module's docstring); false: each replica learns alone.

    With `learnUncontinued`, a first turn that no later turn continued within a horizon
    (`_GAP_MULTIPLE` x the longest recent first-to-second-turn gap, within
    `uncontinuedFloorSeconds` and `uncontinuedCapSeconds`) teaches that sessions on its
    prefix grew 0 blocks: one-shot prefix groups (a system prompt and images, a document,
    each repeat a new question) are then left to the scorers (module docstring). With
    `uncontinuedPrior` (opt-in), before a prefix's own first turn has passed its horizon
    the recent first turns of the request's class decide (API, tools declared, media:
    session_classes.py): all uncontinued, it is left to the scorers too.

    ```yaml
    - type: bounded-sessions-filter
      parameters: {epsilon: 0.25, windowSeconds: 120, maxSessions: 50000,
                   keepTogetherGrowth: 0.5, shareGrowth: true, learnUncontinued: true,
                   uncontinuedPrior: false, uncontinuedFloorSeconds: 2,
                   uncontinuedCapSeconds: 60}
    ```
    """

    type_name: ClassVar[str] = "bounded-sessions-filter"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        epsilon: Annotated[float, msgspec.Meta(ge=0.0)] = 0.25
        # A session idle for longer is no longer counted (its cache is fair game).
        window_seconds: Annotated[float, msgspec.Meta(gt=0.0)] = 120.0
        max_sessions: Annotated[int, msgspec.Meta(gt=0)] = 50_000
        # New sessions expected to grow at most this past their shared prefix (a fraction of
        # its length) are not bounded; 0: every new session is (and nothing is learned).
        keep_together_growth: Annotated[float, msgspec.Meta(ge=0.0)] = 0.5
        # Replicas sharing a Redis index share learned growth (server/shared_growth.py). On
        # by default since the nineteenth session: three replicas at the knee (tenants, seeds
        # 2-4, 11 pairs) bounded 1-18 new sessions for want of growth instead of 37-56, hit
        # ratio higher in 9 of 11 pairs, TTFT p90 lower in 8, median -5% (bench/RESULTS.md).
        share_growth: bool = True
        # First turns no later turn continued within the horizon teach growth 0 (needs
        # keepTogetherGrowth above 0). On by default since the twenty-third session: at 6
        # req/s the hit ratio rose in all 6 pairs (multimodal 61-77% of the oracle -> 69-86%,
        # text 65-71% -> 75-87%), agentic made the same decisions, tenants nearly so
        # (bench/RESULTS.md).
        learn_uncontinued: bool = True
        # Also read a prefix nothing is recorded under as one-shot while none of the recent
        # first turns of the request's class came back (module docstring). Off by default:
        # per class (the twenty-fifth session) it no longer costs agents that declare tools
        # (bench_routing's mixed at 6 req/s: agents' TTFT p90 within 3% or better in 8 of 8
        # order-alternated pairs, one-shot part -0.5 to +7.7 points; multimodal at 16 +1.4/
        # +2.4 points, text even), but agents that declare no tools share one-shot chat's
        # class and pay as before (mixed-toolless: agents' p90 +45%/+106%, 2 pairs; the
        # fleet-wide prior lost 8 of 8). A default must not double a plausible fleet's tail
        # for a few points of one-shot hit ratio; a fleet whose agents declare tools (or
        # that has none) can turn it on (bench/RESULTS.md).
        uncontinued_prior: bool = False
        # The horizon while no first-to-second-turn gap has been seen, and never less: the
        # tests' and a fleet's first sessions come back within it.
        uncontinued_floor_seconds: Annotated[float, msgspec.Meta(gt=0.0)] = 2.0
        # The longest horizon (and never past windowSeconds, after which a chain is gone).
        uncontinued_cap_seconds: Annotated[float, msgspec.Meta(gt=0.0)] = 60.0

    def __init__(
        self, params: Params | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        p = params or self.Params()
        self._eps = p.epsilon
        self._together = p.keep_together_growth
        self.sessions = LiveSessions(
            p.window_seconds,
            p.max_sessions,
            clock,
            learn_growth=self._together > 0,
            share_growth=p.share_growth,
            learn_uncontinued=p.learn_uncontinued,
            uncontinued_prior=p.uncontinued_prior,
            uncontinued_floor_s=p.uncontinued_floor_seconds,
            uncontinued_cap_s=p.uncontinued_cap_seconds,
        )
        # The continuation found while filtering and the blocks some endpoint held, reused
        # by `observe` for the same request.
        self._last: tuple[InferenceRequest, int | None, int] | None = None
        self._stats = SessionBoundStats()

    @property
    def stats(self) -> SessionBoundStats:
        """What the filter did, and what the record learned from uncontinued first turns."""
        sessions = self.sessions
        return replace(
            self._stats,
            uncontinued_learned=sessions.uncontinued_learned,
            uncontinued_untracked=sessions.uncontinued_untracked,
            uncontinued_horizon_s=sessions.uncontinued_horizon() or 0.0,
            uncontinued_unclassed=sessions.unclassed_continued,
        )

    def _lookup(self, req: InferenceRequest, cands: Sequence[Candidate]) -> tuple[int | None, int]:
        # Looked up once per request, by the first plugin to ask (this filter comes first,
        # seeing every candidate's match); later asks with fewer candidates reuse it.
        last = self._last
        if last is not None and last[0] is req:
            return last[1], last[2]
        chain = self.sessions.find(req.block_keys, [c.prefix_blocks for c in cands])
        # Whole blocks only: a tier-weighted match is fractional.
        shared = min(len(req.block_keys), int(max((c.prefix_blocks for c in cands), default=0)))
        self._last = (req, chain, shared)
        return chain, shared

    def _chain(self, req: InferenceRequest, cands: Sequence[Candidate]) -> int | None:
        return self._lookup(req, cands)[0]

    def continues(self, req: InferenceRequest, cands: Sequence[Candidate]) -> bool:
        """Whether `req` is a later turn of a live session."""
        return bool(req.block_keys) and self._chain(req, cands) is not None

    def home(self, req: InferenceRequest, cands: Sequence[Candidate]) -> str | None:
        """The endpoint holding the tail of the session `req` continues (None: a new one)."""
        if not req.block_keys:
            return None
        chain = self._chain(req, cands)
        return None if chain is None else self.sessions.endpoint(chain)

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        if len(cands) < 2 or not req.block_keys or self._chain(req, cands) is not None:
            return cands
        if all(c.prefix_known for c in cands) and not any(c.prefix_blocks for c in cands):
            # A prefix nobody holds joins no group: spreading it is load's business (and
            # no-hit-lru's), and one-shot requests must not be dealt out in turn regardless
            # of a server's queue. When the index could not answer (a degraded lookup) the
            # zeros say nothing: the request may start a session on a shared prompt, and
            # bounding it keeps sessions spread while the index is away, as when it answers.
            return cands
        shared = self._lookup(req, cands)[1]
        stats = self._stats
        if self._together > 0 and shared > 0 and all(c.prefix_known for c in cands):
            self.sessions.settle()
            learned = self.sessions.learned(req.block_keys, shared)
            growth = None
            if learned is not None:
                grew, at = learned
                growth = (len(req.block_keys) - shared + grew) / shared
                if grew == 0 and at > shared - _GROUP_STRIDE and self.sessions.learns_uncontinued:
                    # Read at its own shared prefix, where no session has come back (first
                    # turns went uncontinued, none grew): its own part is written once and
                    # will not grow wherever it goes, however long (multimodal: images in
                    # another order, 51 own blocks past 39 shared, were bounded at 1.31).
                    growth = 0.0
                # Read under the first blocks only: what sessions on a header shared more
                # widely (every tenant's) showed, not this prompt's own.
                stats.header_growth += learned[1] <= _HEAD_BLOCKS
            elif self.sessions.sessions_come_back(session_class(req)) is False:
                # Nothing known of this prefix, and no session of its class anywhere came
                # back lately: the class's traffic is one-shot, expected to grow as its
                # first turns did.
                stats.uncontinued_prior += 1
                growth = 0.0
            if growth is not None and growth <= self._together:
                # Its group's sessions stay small beside what they share: keeping them
                # together costs less cache than writing the prefix on another server.
                stats.kept_together += 1
                return cands
            stats.growth_unknown += growth is None
        stats.bounded += 1
        counts = self.sessions.counts()
        live = [counts.get(c.endpoint.address, 0) for c in cands]
        caps = [_capacity(c) for c in cands]
        if all(caps):
            total_cap = sum(caps)  # type: ignore[arg-type]
            shares = [cap / total_cap for cap in caps]  # type: ignore[operator]
        else:
            shares = [1.0 / len(cands)] * len(cands)
        total = sum(live) + 1
        keep = [
            c
            for c, n, share in zip(cands, live, shares, strict=True)
            if n + 1 <= session_bound(total * share, self._eps)
        ]
        most = max(c.prefix_blocks for c in cands)
        if most > 0 and keep and all(c.prefix_blocks < most for c in keep):
            stats.holders_removed += 1
        return keep or cands

    def observe(
        self, req: InferenceRequest, cands: Sequence[Candidate], decision: Decision
    ) -> None:
        if not decision.endpoints or not req.block_keys:
            return
        chain = self._chain(req, cands)
        self._last = None
        self.sessions.touch(chain, decision.primary.address, req.block_keys, session_class(req))


class SessionTailScorer:
    """For a later turn of a live session, 1.0 on the endpoint its tail grew on and 0
    elsewhere, while that endpoint still holds more of the request than any other; 1.0
    everywhere for a request that starts a session, and for one whose tail its home has
    evicted. Needs a `bounded-sessions-filter` in the same config (it keeps the record of
    sessions).

    A hysteresis, not a second affinity measure: moving a session recomputes its tail and
    leaves the old copy occupying the first server's cache until evicted, a cost the
    per-request TTFT prediction does not see. Next to `predicted-ttft-scorer` (weight 4),
    weight 2 keeps a session home until its predicted TTFT there is about twice the best
    elsewhere; two sessions whose turns arrive together on one server no longer swap
    servers on a near-tie.

    Once the index no longer credits the home with more of the request than elsewhere (its
    capacity model, or KV events, say the tail was evicted: a cache holding many tenants'
    prompts turns over faster than a chat's next turn comes), moving costs nothing the
    prediction misses, and holding the turn home only queued a full recompute behind that
    server's work (issue 14, tenants workload: in one traced run, 20 of the 66 requests
    slower than round-robin's p90).

    ```yaml
    - type: session-tail-scorer
    ```
    """

    type_name: ClassVar[str] = "session-tail-scorer"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        pass

    def __init__(self, params: Params | None = None) -> None:
        self._sessions: BoundedSessionsFilter | None = None

    def bind(self, plugins: Mapping[str, object]) -> None:
        self._sessions = next(
            (p for p in plugins.values() if isinstance(p, BoundedSessionsFilter)), None
        )
        if self._sessions is None:
            raise ConfigError(f"{self.type_name} needs a bounded-sessions-filter plugin")

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        home = self._sessions.home(req, cands) if self._sessions is not None else None
        at_home = [c.endpoint.address == home for c in cands]
        if home is None or not any(at_home):
            return [1.0] * len(cands)
        if not all(c.prefix_known for c in cands):
            # The index did not answer (Redis slow or down): nothing says the tail is gone,
            # and the session record is the one sign of where it lives.
            return [1.0 if h else 0.0 for h in at_home]
        held = max(c.prefix_blocks for c, h in zip(cands, at_home, strict=True) if h)
        elsewhere = max(
            (c.prefix_blocks for c, h in zip(cands, at_home, strict=True) if not h), default=0.0
        )
        if held <= elsewhere:
            return [1.0] * len(cands)
        return [1.0 if h else 0.0 for h in at_home]
