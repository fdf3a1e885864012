"""An endpoint that restarts or leaves the pool takes its sessions' tails with its cache: the
session record stops counting them there, and each one's next turn is placed as a new
session on its prefix is, its chain kept so what it grows is still learned."""

from __future__ import annotations

from extproc.core import Decision
from extproc.scheduling.plugins.sessions import (
    BoundedSessionsFilter,
    LiveSessions,
    SessionTailScorer,
)
from extproc.testing import ManualClock
from tests.scheduling.helpers import cand
from tests.scheduling.test_sessions import SHARED, held, place, turn


def _two_sessions_on_each_of_a_and_b(clock: ManualClock) -> tuple[BoundedSessionsFilter, dict]:
    """A filter (epsilon 0) that placed four sessions' first turns on the shared prompt, two
    on "a" and two on "b"; where each went."""
    f = BoundedSessionsFilter(BoundedSessionsFilter.Params(epsilon=0.0), clock=clock)
    home: dict[int, str] = {}
    for s in range(4):
        cands = [cand(a, prefix=len(SHARED) if a in home.values() else 0) for a in "ab"]
        home[s] = place(f, turn(s, 0), cands)
    assert f.sessions.counts() == {"a": 2, "b": 2}
    return f, home


def test_a_restarted_endpoint_carries_none_of_its_sessions_for_new_ones():
    clock = ManualClock()
    f, _ = _two_sessions_on_each_of_a_and_b(clock)
    f.endpoint_reset("b")
    assert f.sessions.counts() == {"a": 2}
    assert f.stats.reset_sessions == 2
    # The restarted server holds nothing; counted with its old sessions it was within the
    # bound like "a" (3 of 5), and a cache scorer sent the new session to the holder "a".
    cands = [cand("a", prefix=len(SHARED)), cand("b")]
    assert place(f, turn(4, 0), cands) == "b"
    assert f.sessions.counts() == {"a": 2, "b": 1}


def test_a_later_turn_of_a_reset_session_is_placed_as_a_new_one_and_still_teaches_growth():
    clock = ManualClock()
    f, home = _two_sessions_on_each_of_a_and_b(clock)
    on_b = next(s for s, a in home.items() if a == "b")
    f.endpoint_reset("b")
    clock.advance(1.0)
    r = turn(on_b, 1)
    # Its tail went with b's cache: no home to hold it to, nor to spare it the load bound.
    cands = [cand("a", prefix=len(SHARED)), cand("b")]
    assert f.home(r, cands) is None and not f.continues(r, cands)
    scorer = SessionTailScorer()
    scorer.bind({"f": f})
    assert scorer.score(r, cands) == [1.0, 1.0]
    # Bounded as a new session is ("a" carries 2 of 3): it goes back to the emptied "b".
    assert f.filter(r, cands) == [cands[1]]
    assert f.stats.reset_turns == 1 and f.stats.bounded == 4
    f.observe(r, cands, Decision(endpoints=(cands[1].endpoint,)))
    assert f.sessions.counts() == {"a": 2, "b": 1}
    # Its chain was kept: the turn continued it (not a new session of 39 blocks), and the
    # 5 blocks it grew past its 34-block first turn are learned for its prompt.
    assert len(f.sessions) == 4
    assert f.sessions.learned(turn(9, 0).block_keys, len(SHARED)) == (5, 24)
    # Homed again: its next turn is a continuation, kept home by the tail scorer.
    nxt = turn(on_b, 2)
    back = [cand("a", prefix=len(SHARED)), cand("b", prefix=held(on_b, 1))]
    assert f.home(nxt, back) == "b" and f.filter(nxt, back) == back


def test_sessions_of_an_endpoint_that_left_expire_without_counting_anywhere():
    clock = ManualClock()
    sessions = LiveSessions(window_s=10.0, max_sessions=100, clock=clock)
    sessions.touch(None, "a", turn(0, 0).block_keys)
    sessions.touch(None, "b", turn(1, 0).block_keys)
    assert sessions.reset("b") == 1 and sessions.reset("b") == 0
    chain = sessions.find(turn(1, 1).block_keys, [])
    assert chain is not None and sessions.endpoint(chain) is None
    clock.advance(11.0)
    assert sessions.counts() == {} and len(sessions) == 0


def test_a_peer_placement_made_before_the_reset_is_applied_homeless():
    # Each replica hears of a restart from its own (or a shared) scrape; a peer's placement
    # there read after it (a batch on its way, or behind a slow read) was made on the
    # old process, and its tail is gone too.
    clock = ManualClock()
    sessions = LiveSessions(window_s=60.0, max_sessions=100, clock=clock)
    clock.advance(5.0)
    sessions.reset("b")
    old = tuple(turn(0, 0).block_keys[-2:])
    sessions.apply(((), "b", old, 34, ""), age_s=1.0)
    assert sessions.counts() == {}
    assert sessions.endpoint(sessions.find(turn(0, 1).block_keys, [])) is None  # type: ignore[arg-type]
    clock.advance(1.0)
    new = tuple(turn(1, 0).block_keys[-2:])
    sessions.apply(((), "b", new, 34, ""), age_s=0.5)  # made after the reset
    assert sessions.counts() == {"b": 1}


def _router_with_two_sessions_on_each_of_a_and_b():
    """A router on the default profile and its session filter, sessions 0-3 on a, b, a, b."""
    from extproc.core import Endpoint
    from extproc.endpoints.pool import EndpointPool
    from extproc.router import Router
    from extproc.scheduling.config import build_scheduler, default_config
    from extproc.testing import plugin_registry

    router = Router(
        pool=EndpointPool([Endpoint("a"), Endpoint("b")]),
        scheduler=build_scheduler(default_config(), plugin_registry()),
        parser=lambda *_: None,  # type: ignore[arg-type,return-value]
    )
    (f,) = [p for p in router.scheduler.plugins if isinstance(p, BoundedSessionsFilter)]
    for s, a in enumerate("abab"):
        f.sessions.touch(None, a, turn(s, 0).block_keys)
    return router, f


async def test_the_router_tells_the_session_record_when_an_endpoint_is_forgotten():
    # The assembled server calls `forget_endpoint` when the scraper sees a restart, or an
    # endpoint leaves the pool (server/assembly.py, lifecycle.py).
    router, f = _router_with_two_sessions_on_each_of_a_and_b()
    await router.forget_endpoint("b")
    assert f.sessions.counts() == {"a": 2} and f.stats.reset_sessions == 2


def test_a_cleared_cache_makes_its_sessions_homeless_as_a_restart_does():
    # The engine emptied its prefix cache and kept running (precise mode's AllBlocksCleared):
    # the tails are gone as on a restart, so the tail affinity goes and the sessions stop
    # counting there; the bound still applies to each one's next turn.
    clock = ManualClock()
    f, home = _two_sessions_on_each_of_a_and_b(clock)
    on_b = sorted(s for s, a in home.items() if a == "b")
    f.cache_cleared("b")
    assert f.sessions.counts() == {"a": 2} and f.stats.reset_sessions == 2
    # A new session goes to the emptied "b" ("a" carries 2 of 3): counted with its old
    # sessions, "b" was within the bound like "a" and the holder "a" took it.
    assert place(f, turn(4, 0), [cand("a", prefix=len(SHARED)), cand("b")]) == "b"
    r = turn(on_b[0], 1)
    cands = [cand("a", prefix=len(SHARED)), cand("b", prefix=len(SHARED))]
    assert f.home(r, cands) is None
    scorer = SessionTailScorer()
    scorer.bind({"f": f})
    assert scorer.score(r, cands) == [1.0, 1.0]
    # Placed as a new session is, bounded: "a" carries 2 of 4 with it, over its share.
    assert f.filter(r, cands) == [cands[1]] and f.stats.reset_turns == 1
    f.observe(r, cands, Decision(endpoints=(cands[1].endpoint,)))
    assert f.sessions.counts() == {"a": 2, "b": 2}
    # Homed again on "b"; the other session's turn is still homeless, bounded (2 and 2 of
    # 5: both within it).
    assert f.home(turn(on_b[0], 2), cands) == "b"
    r2 = turn(on_b[1], 1)
    assert f.home(r2, cands) is None and f.filter(r2, cands) == cands
    assert f.stats.reset_turns == 2 and f.stats.bounded == 6


async def test_the_router_tells_the_session_record_when_a_cache_is_cleared():
    # The KV-event subscriber calls `cache_cleared` on an AllBlocksCleared
    # (server/assembly.py `on_cleared`).
    router, f = _router_with_two_sessions_on_each_of_a_and_b()
    router.cache_cleared("b")
    assert f.sessions.counts() == {"a": 2} and f.stats.reset_sessions == 2
