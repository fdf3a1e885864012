"""Live sessions per endpoint, and a bound on them for placing new sessions.

Agentic and chat sessions are idle between turns (a tool runs, a user types), so in-flight
counts barely see them: when a new session arrives, the server holding the shared agent
prompt looks idle and predicted TTFT sends it there, and the next, and the next. Their tails
then grow past that server's KV capacity and sessions get moved mid-way, each move
recomputing a long tail. What a server really carries is its live sessions: chains of turns
that will come back and keep growing there (session_chains.py: how a session is recognised
by its own blocks, and found again).

`BoundedSessionsFilter` applies consistent hashing with bounded loads to new sessions only: an
endpoint may take a new session while its live sessions stay within `(1 + epsilon)` times its
share (by KV capacity) of all live sessions. The hot shared prefix is thereby replicated on
more servers, deliberately and early, and each session's later turns are left to the
scorers (its tail pulls it back where it grew). Continuations are never filtered.

Optionally (`keepTogetherGrowth`), the bound is only for sessions that grow. A chat
tenant's new conversation is also a new session on a known prefix (the tenant's prompt),
but it ends after a turn or two having added a fraction of what it shares: bounding it
only wrote big tenants' prompts onto five or six servers (issue 14, tenants: the holder
filtered out in 13-28 requests a run). So a new session is looked up in what continued
sessions have taught (session_growth.py: how many blocks sessions that started on its
prefix grew past their first turn, read at the longest recorded prefix within what the
index holds of it), and expects to end that far past its own first turn. One whose expected
part of its own (its first turn past the shared prefix, plus that growth) stays within
`keepTogetherGrowth` of the shared prefix is left to the scorers; one on a prefix no session
has been seen continued on is bounded (an agentic first fill shows nothing before the bound
must act). With `learnUncontinued` (and `uncontinuedPrior`), first turns nothing continued
teach growth 0, so one-shot prefix groups are left to the scorers too (session_fates.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Annotated, ClassVar

import msgspec

from extproc.core import Candidate, Decision, InferenceRequest
from extproc.errors import ConfigError
from extproc.scheduling.plugins.session_chains import LiveSessions, Touch
from extproc.scheduling.plugins.session_classes import session_class
from extproc.scheduling.plugins.session_growth import GROUP_STRIDE, HEAD_BLOCKS, Grown

log = logging.getLogger(__name__)

# LiveSessions, Touch and Grown are imported from here by the replicas' sharing
# (server/shared_sessions.py, shared_growth.py), the tests and the benches.
__all__ = [
    "BoundedSessionsFilter",
    "Grown",
    "LiveSessions",
    "SessionBoundStats",
    "SessionTailScorer",
    "Touch",
    "session_bound",
]


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
    `HEAD_BLOCKS` blocks: a header wider than the session's own prompt, the coarsest
    fallback). With `learnUncontinued`: `uncontinued_learned` (first turns recorded as grown
    0 blocks, no later turn having come within the horizon), `uncontinued_untracked` (first
    turns not watched for want of room: they teach nothing), and `uncontinued_horizon_s`
    (the horizon now, seconds); with `uncontinuedPrior`, `uncontinued_prior` (new sessions
    on a prefix nothing was recorded under, kept together because no first turn in the
    fleet's recent ones came back) and `uncontinued_unclassed` (first turns continued whose
    class a peer replica did not send: each ends the prior for every class). On endpoint
    resets (a restart or a departure) and cleared caches (the engine kept running):
    `reset_sessions` (live sessions homed on the endpoint, no longer counted there) and
    `reset_turns` (later turns of such sessions, placed as a new session is: on a prefix some
    endpoint holds, also counted as bounded or kept together)."""

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
    reset_sessions: int = 0
    reset_turns: int = 0


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
    session_growth.py); false: each replica learns alone.

    With `learnUncontinued`, a first turn that no later turn continued within a horizon
    (`_GAP_MULTIPLE` x the longest recent first-to-second-turn gap, within
    `uncontinuedFloorSeconds` and `uncontinuedCapSeconds`) teaches that sessions on its
    prefix grew 0 blocks: one-shot prefix groups (a system prompt and images, a document,
    each repeat a new question) are then left to the scorers (session_fates.py). With
    `uncontinuedPrior` (opt-in), before a prefix's own first turn has passed its horizon
    the recent first turns of the request's class decide (API, tools declared, media:
    session_classes.py): all uncontinued, it is left to the scorers too.

    When an endpoint restarts or leaves the pool, or its engine clears its prefix cache
    (precise mode), the sessions homed there stop counting against it, and each one's next
    turn, its tail gone with the cache, is placed as a new session on its prefix is (what its
    growth teaches is still learned).

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
        # first turns of the request's class came back (session_fates.py). Off by default:
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
        """Whether `req` is a later turn of a live session whose home still holds its tail
        as far as the record knows (not one whose endpoint was reset since: moving that one
        costs no tail)."""
        return self.home(req, cands) is not None

    def home(self, req: InferenceRequest, cands: Sequence[Candidate]) -> str | None:
        """The endpoint holding the tail of the session `req` continues (None: a new one,
        or one whose endpoint was reset since its last turn)."""
        if not req.block_keys:
            return None
        chain = self._chain(req, cands)
        return None if chain is None else self.sessions.endpoint(chain)

    def endpoint_reset(self, address: str) -> None:
        """`address` restarted or left the pool (`EndpointReset`): the sessions homed there
        lost their tails with its cache. They stop counting against it, so new sessions are
        not kept off a server that carries none of them, and each one's next turn is placed
        as a new session is (bounded, or kept together on its expected growth), its tail
        being nowhere: left as a continuation, it went unbounded to whichever server held
        the shared prompt, the pile-up this filter exists to prevent. Its chain stays, so
        the turn still teaches the session's growth past its first turn
        (`LiveSessions.reset`)."""
        self._lost_tails(address, "restarted or left")

    def cache_cleared(self, address: str) -> None:
        """`address`'s engine emptied its prefix cache and kept running (`CacheCleared`,
        precise mode's AllBlocksCleared): the sessions homed there lost their tails as on a
        restart, and are made homeless the same way (`endpoint_reset`).

        They also stop counting for the bound there, though the server keeps its queue and
        running requests. The count is a forecast of what will come back and grow in a
        server's cache: a session whose tail is gone comes back to this server no more than
        to any other, and its next turn is itself bounded when it is placed, so the
        homeless sessions spread again within the bound instead of piling up anywhere.
        Counted on, they kept new sessions off the one server that now holds none of them
        and sent them to the prompt's holders. The load still running there is the load
        plugins' to see (in-flight and scraped queues; `predicted-ttft-scorer` keeps its
        queue on a clear too). A turn still queued at the clear (vLLM clears only with no
        request holding blocks, or with `reset_running_requests`, which requeues them)
        writes its tail again afterwards: its session's next turn, bounded, finds that
        server holding the most of it in the index, and with room under the bound, the
        server's count having just dropped."""
        self._lost_tails(address, "cleared its prefix cache")

    def _lost_tails(self, address: str, why: str) -> None:
        n = self.sessions.reset(address)
        self._stats.reset_sessions += n
        if n:
            log.info(
                "bounded-sessions-filter: %s %s: its %d live sessions no longer count "
                "there, their next turns are placed as new sessions",
                address,
                why,
                n,
            )

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        if len(cands) < 2 or not req.block_keys:
            return cands
        chain = self._chain(req, cands)
        if chain is not None:
            if self.sessions.endpoint(chain) is not None:
                return cands
            # A later turn of a session whose endpoint was reset: its tail is gone, so it is
            # placed where a new session on its prefix would be.
            self._stats.reset_turns += 1
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
                if grew == 0 and at > shared - GROUP_STRIDE and self.sessions.learns_uncontinued:
                    # Read at its own shared prefix, where no session has come back (first
                    # turns went uncontinued, none grew): its own part is written once and
                    # will not grow wherever it goes, however long (multimodal: images in
                    # another order, 51 own blocks past 39 shared, were bounded at 1.31).
                    growth = 0.0
                # Read under the first blocks only: what sessions on a header shared more
                # widely (every tenant's) showed, not this prompt's own.
                stats.header_growth += learned[1] <= HEAD_BLOCKS
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
