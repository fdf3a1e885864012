"""First turns waiting to learn their fate: continued, or not within a horizon.

`bounded-sessions-filter` bounds a new session on a prefix no session has been seen
continued on (sessions.py). The price falls on one-shot prefix groups: prompts that share a
system prompt and images but are never continued (bench_routing's multimodal and text
workloads). Every repeat of such a group is a new session of unknown growth, and nothing is
ever learned for it, so each is bounded: on multimodal at 6 req/s, 12-15 of 48 repeats had
every holder removed and wrote the group's prefix on another server (hit ratio 68-77% of the
oracle against 88-93% with the bound off; bench/RESULTS.md, twenty-second session). No
request tells such a repeat from an agent's second session on a new prompt
(tests/e2e/test_session_spread.py sends exactly that); only what comes later does.

So, optionally (`learnUncontinued`), what comes later is read: a first turn that no later
turn continued within a horizon grew 0 blocks past itself, and is recorded as a continued
session's growth would be (session_growth.py: under the same keys, the most seen kept: one
agent session on the prefix that does continue, before or after, keeps its group bounded).
The horizon is measured, not set: a multiple of the longest of the recent
first-to-second-turn gaps the picker saw (a session's next turn comes after its answer and
the client's think or tool time, which continued sessions show), never under a floor (no gap
seen yet: the first sessions of a fleet whose sessions come back slowly) nor over a cap
(within the window a chain is remembered). A wrong call costs only the new sessions placed
before the late turn arrives: that turn records its real growth, and the group is bounded
again.

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
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from typing import NamedTuple

from extproc.scheduling.plugins.session_classes import UNKNOWN_CLASS, ClassOutcomes

log = logging.getLogger(__name__)

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
# one per `GROUP_STRIDE` blocks and its first `HEAD_BLOCKS`, 263 for 2,048 blocks): at
# ~45 bytes a key, 12 MiB at most, whatever the request rate and prompt lengths. Past it a
# first turn is not tracked (counted, and said in a log line).
_PENDING_KEYS = 1 << 18


class Waiting(NamedTuple):
    """A first turn waiting for its horizon: placed at `at` as chain `chain_id`; `placed` is
    the chain record's entry as placed (compared by identity: a continuation or a forgotten
    chain replaces it; None: already gone); `keys` are those its growth is recorded under.
    A NamedTuple, not a frozen dataclass: one is built for every new session, and a frozen
    dataclass's __init__ sets each field through object.__setattr__."""

    at: float
    chain_id: int
    placed: object | None
    keys: tuple[int, ...]


class FirstTurnFates:
    """The first turns placed here waiting for their horizon (at most `max_waiting`, and
    `_PENDING_KEYS` keys among them), the recent first-to-second-turn gaps that set the
    horizon, and each class's recent fates (`uncontinued_prior`). `enabled` False
    (`learnUncontinued` off): nothing waits and there is no horizon."""

    def __init__(
        self,
        max_waiting: int,
        *,
        enabled: bool,
        prior: bool,
        floor_s: float,
        cap_s: float,
    ) -> None:
        self._max = max_waiting
        self._enabled = enabled
        self._prior = enabled and prior
        self._cap = cap_s
        self._floor = min(floor_s, cap_s)
        # Oldest first; `_pending_keys` keys in all.
        self._pending: deque[Waiting] = deque()
        self._pending_keys = 0
        # The most recent first-to-second-turn gaps (seconds), here or at a peer.
        self._gaps: deque[float] = deque(maxlen=_GAPS)
        # The most recent first turns' fates per class: continued, or not within the horizon.
        self._outcomes = ClassOutcomes(_OUTCOMES, _PRIOR_MIN)
        # First turns recorded as not continued, and first turns not tracked for want of room.
        self.learned = 0
        self.untracked = 0
        # First turns continued whose class was not known (a peer that does not send it):
        # each counted as come back for every class.
        self.unclassed = 0

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def waiting(self) -> int:
        """First turns waiting for their horizon."""
        return len(self._pending)

    @property
    def waiting_keys(self) -> int:
        """Block keys the waiting first turns hold."""
        return self._pending_keys

    def come_back(self, cls: str) -> bool | None:
        """The prior for class `cls` (None with `uncontinued_prior` off)."""
        if not self._prior:
            return None
        return self._outcomes.come_back(cls)

    def horizon(self) -> float | None:
        """`_GAP_MULTIPLE` x the longest recent gap, within the floor and cap; None: off."""
        if not self._enabled:
            return None
        gaps = self._gaps
        seen = _GAP_MULTIPLE * max(gaps) if gaps else 0.0
        return min(self._cap, max(self._floor, seen))

    def wait(self, turn: Waiting) -> None:
        """Watches a first turn just placed (`placed` None: its chain is already gone),
        unless too many wait already: then it is counted, and said in a log line now and
        then."""
        if len(self._pending) >= self._max or self._pending_keys + len(turn.keys) > _PENDING_KEYS:
            # First turns arriving faster than their horizon lets them go: this one will
            # teach nothing if it is not continued (its group stays bounded, as without
            # the option).
            self.untracked += 1
            if self.untracked & (self.untracked - 1) == 0:
                log.warning(
                    "bounded-sessions-filter: %d first turns not tracked for continuation "
                    "(%d waiting, %d keys); one-shot groups among them stay bounded",
                    self.untracked,
                    len(self._pending),
                    self._pending_keys,
                )
            return
        if turn.placed is not None:
            self._pending.append(turn)
            self._pending_keys += len(turn.keys)

    def due(self, now: float) -> Iterator[Waiting]:
        """Takes out the first turns whose horizon has passed by `now`, oldest first; the
        caller tells which went uncontinued (`uncontinued`)."""
        pending = self._pending
        due = now - (self.horizon() or 0.0)
        while pending and pending[0].at <= due:
            turn = pending.popleft()
            self._pending_keys -= len(turn.keys)
            yield turn

    def uncontinued(self, cls: str) -> None:
        """A first turn of class `cls` passed its horizon with no later turn."""
        self.learned += 1
        self._outcomes.add(cls, False)

    def continued(self, cls: str, gap_s: float) -> None:
        """A first turn of class `cls` was continued `gap_s` after it was placed."""
        self._gaps.append(gap_s)
        self._outcomes.add(cls, True)
        if cls == UNKNOWN_CLASS:
            self.unclassed += 1
            n = self.unclassed
            if self._prior and n & (n - 1) == 0:
                log.warning(
                    "bounded-sessions-filter: %d continued sessions of no known class (a peer "
                    "replica that does not send it); each ends uncontinuedPrior for every "
                    "class",
                    n,
                )
