"""`bounded-sessions-filter` learning from first turns that nothing continued (issue 14,
twenty-third session): a one-shot prefix group (a system prompt and images, each repeat a
new question) teaches, once its first request's horizon passes without a next turn, that
sessions on its prefix grow 0 blocks, and its later repeats stay with the prefix's holder;
an agent group whose sessions come back is still bounded."""

from __future__ import annotations

import dataclasses

import pytest

from extproc.core import Decision, InferenceRequest
from extproc.scheduling.plugins import session_fates
from extproc.scheduling.plugins.sessions import BoundedSessionsFilter, LiveSessions
from extproc.testing import ManualClock
from tests.scheduling.helpers import addrs, cand, req

SHARED = tuple(range(1, 30))  # a group's system prompt (and images): 29 blocks
SERVERS = "abcd"


def ask(q: int, own: int = 2) -> InferenceRequest:
    """A one-shot request of the group: SHARED, then `own` blocks of question `q`."""
    mine = tuple(10_000 * (q + 1) + i for i in range(own))
    return dataclasses.replace(req(tokens=64 * (len(SHARED) + own)), block_keys=SHARED + mine)


def on(f: BoundedSessionsFilter, r: InferenceRequest, endpoint: str, cands) -> None:
    f.observe(r, cands, Decision(endpoints=(cand(endpoint).endpoint,)))


def holding(*holders: str):
    return [cand(a, prefix=len(SHARED) if a in holders else 0) for a in SERVERS]


def test_a_one_shot_groups_repeats_stay_with_the_holder_once_its_first_went_uncontinued():
    clock = ManualClock()
    f = BoundedSessionsFilter(clock=clock)
    nobody = holding()
    f.filter(ask(0), nobody)
    on(f, ask(0), "a", nobody)
    # A repeat 1 s later: the first request may still come back (the 2 s floor, no gap seen
    # yet), so the repeat is bounded as an agent's second session would be: a holds one
    # session, its share of two is a half, and it is filtered out.
    clock.advance(1.0)
    kept = f.filter(ask(1), holding("a"))
    assert "a" not in addrs(kept) and f.stats.growth_unknown == 1
    on(f, ask(1), "b", holding("a"))
    # 2.5 s after the first: it went uncontinued, sessions on the prefix grew 0 blocks
    # (2 own blocks past 29 shared), and the next repeats are left to the scorers.
    clock.advance(1.5)
    for q in (2, 3, 4):
        assert f.filter(ask(q), holding("a", "b")) == holding("a", "b")
        on(f, ask(q), "a", holding("a", "b"))
    s = f.stats
    assert s.kept_together == 3 and s.uncontinued_learned == 1, s
    assert s.uncontinued_horizon_s == 2.0  # the floor: no session ever came back


def test_a_group_continued_later_is_bounded_again():
    clock = ManualClock()
    f = BoundedSessionsFilter(clock=clock)
    on(f, ask(0), "a", holding())
    clock.advance(3.0)
    assert f.filter(ask(1), holding("a")) == holding("a")  # learned: grew 0
    on(f, ask(1), "a", holding("a"))
    # The first request comes back after all, with a long next turn (20 blocks): its real
    # growth outranks the 0, and the group's new sessions are bounded again.
    later = dataclasses.replace(
        ask(0), block_keys=ask(0).block_keys + tuple(90_000 + i for i in range(20))
    )
    cands = [cand(a, prefix=len(ask(0).block_keys) if a == "a" else 0) for a in SERVERS]
    assert f.continues(later, cands)
    on(f, later, "a", cands)
    clock.advance(3.0)
    assert "a" not in addrs(f.filter(ask(2), holding("a")))
    assert f.stats.bounded == 1 and f.stats.growth_unknown == 0, f.stats


def test_first_turns_started_within_the_floor_still_spread_evenly():
    """tests/e2e/test_session_spread.py's pattern: 8 new sessions on one prompt one after
    another, none continued yet; within the floor nothing is learned and the bound deals
    them 2/2/2/2, as agent sessions need."""
    clock = ManualClock()
    f = BoundedSessionsFilter(clock=clock)
    placed: list[str] = []
    for q in range(8):
        cands = holding(*placed)
        kept = f.filter(ask(q), cands)
        chosen = max(kept, key=lambda c: c.prefix_blocks).endpoint.address
        on(f, ask(q), chosen, cands)
        placed.append(chosen)
        clock.advance(0.2)
    assert sorted(placed) == ["a", "a", "b", "b", "c", "c", "d", "d"], placed
    assert f.stats.uncontinued_learned == 0 and f.stats.kept_together == 0


def sessions(clock: ManualClock, **kw) -> LiveSessions:
    return LiveSessions(120.0, 1000, clock, learn_growth=True, learn_uncontinued=True, **kw)


def test_the_horizon_follows_the_gaps_sessions_come_back_after():
    clock = ManualClock()
    live = sessions(clock, uncontinued_floor_s=2.0, uncontinued_cap_s=60.0)
    assert live.uncontinued_horizon() == 2.0  # nothing came back yet: the floor
    # A session comes back 5 s after its first turn: 4 x 5 s from then on.
    live.touch(None, "a", ask(0).block_keys)
    clock.advance(5.0)
    nxt = (*ask(0).block_keys, 77_777)
    live.touch(live.find(nxt), "a", nxt)
    assert live.uncontinued_horizon() == 20.0
    # A first turn is not recorded 10 s on (a session might come back as late as that)...
    live.touch(None, "b", ask(1).block_keys)
    clock.advance(10.0)
    live.settle()
    assert live.uncontinued_learned == 0
    # ...but is at 20 s.
    clock.advance(10.0)
    live.settle()
    assert live.uncontinued_learned == 1
    assert live.learned(ask(2).block_keys, len(SHARED)) is not None
    # A very slow comeback (40 s): capped at 60 s, never past the 120 s window either.
    live.touch(None, "c", ask(3).block_keys)
    clock.advance(40.0)
    nxt = (*ask(3).block_keys, 88_888)
    live.touch(live.find(nxt), "c", nxt)
    assert live.uncontinued_horizon() == 60.0
    capped = LiveSessions(30.0, 10, clock, learn_growth=True, learn_uncontinued=True)
    assert capped.uncontinued_horizon() == 2.0
    capped._fates.continued("chat", 100.0)  # a first turn came back 100 s on
    assert capped.uncontinued_horizon() == 30.0


def test_a_first_turn_continued_in_time_teaches_nothing_uncontinued():
    clock = ManualClock()
    live = sessions(clock)
    live.touch(None, "a", ask(0).block_keys)
    clock.advance(1.0)
    nxt = ask(0).block_keys + tuple(range(50_000, 50_020))
    live.touch(live.find(nxt), "a", nxt)
    clock.advance(60.0)
    live.settle()
    assert live.uncontinued_learned == 0
    assert live.learned(ask(1).block_keys, len(SHARED)) == (20, 24)


def test_peers_learn_an_uncontinued_first_turn():
    """Published like a continued session's growth (server/shared_growth.py sends what
    `on_grown` gets): a peer merges it and keeps the group's repeats together too."""
    clock = ManualClock()
    a = sessions(clock, share_growth=True)
    b = sessions(clock, share_growth=True)
    sent: list = []
    a.on_grown = sent.append
    a.touch(None, "x", ask(0).block_keys)
    clock.advance(2.0)
    a.settle()
    ((grew, keys),) = sent
    # Growth 0, under the first 7 blocks and every 8th of the first turn.
    assert grew == 0 and keys == (*SHARED[:7], SHARED[7], SHARED[15], SHARED[23])
    assert b.learned(ask(1).block_keys, len(SHARED)) is None
    b.merge_growth(sent[0])
    assert b.learned(ask(1).block_keys, len(SHARED)) == (0, 24)
    # Learned again (another repeat uncontinued): nothing rose, nothing sent.
    a.touch(None, "x", ask(1).block_keys)
    clock.advance(2.0)
    a.settle()
    assert a.uncontinued_learned == 2 and len(sent) == 1


def test_first_turns_waiting_for_their_horizon_are_bounded(monkeypatch):
    clock = ManualClock()
    live = LiveSessions(120.0, 10, clock, learn_growth=True, learn_uncontinued=True)
    for q in range(25):
        live.touch(None, "a", ask(q).block_keys)
    # At most `max_sessions` waiting; the rest counted, teaching nothing.
    assert live._fates.waiting == 10 and live.uncontinued_untracked == 15
    # And at most `_PENDING_KEYS` keys among them (a long first turn holds 263).
    monkeypatch.setattr(session_fates, "_PENDING_KEYS", 30)
    keys = LiveSessions(120.0, 1000, clock, learn_growth=True, learn_uncontinued=True)
    for q in range(5):
        keys.touch(None, "a", ask(q, own=40).block_keys)  # 69 blocks: 7 + 8 keys each
    assert keys._fates.waiting == 2 and keys._fates.waiting_keys == 30
    assert keys.uncontinued_untracked == 3
    clock.advance(2.0)
    keys.settle()
    assert keys._fates.waiting_keys == 0 and keys.uncontinued_learned == 2
    keys.touch(None, "a", ask(9, own=40).block_keys)  # room again
    assert keys.uncontinued_untracked == 3


def test_off_learns_nothing_from_uncontinued_first_turns():
    clock = ManualClock()
    f = BoundedSessionsFilter(BoundedSessionsFilter.Params(learn_uncontinued=False), clock=clock)
    on(f, ask(0), "a", holding())
    clock.advance(60.0)
    assert "a" not in addrs(f.filter(ask(1), holding("a")))
    assert f.stats.uncontinued_learned == 0 and f.stats.uncontinued_horizon_s == 0.0
    assert f.sessions.uncontinued_horizon() is None


@pytest.mark.parametrize("param", ["uncontinuedFloorSeconds", "uncontinuedCapSeconds"])
def test_horizon_bounds_must_be_positive(param):
    import msgspec

    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({param: 0}, BoundedSessionsFilter.Params)


def test_a_repeat_with_a_long_part_of_its_own_stays_too_but_not_on_a_header_record():
    """Multimodal: a repeat whose images come in another order shares only the system part
    and has more of its own than it shares; sessions on the prefix grew 0 blocks (none came
    back), so its own part will not grow either: left to the scorers. A 0 read under a
    header only (first blocks other prompts share) says nothing of this prompt: bounded."""
    clock = ManualClock()
    f = BoundedSessionsFilter(clock=clock)
    on(f, ask(0, own=40), "a", holding())
    clock.advance(2.0)
    assert f.filter(ask(1, own=40), holding("a")) == holding("a")  # 40 own past 29 shared
    assert f.stats.kept_together == 1
    header = SHARED[:6]
    other = dataclasses.replace(
        req(tokens=64 * 46), block_keys=header + tuple(range(70_000, 70_040))
    )
    cands = [cand(a, prefix=len(header) + 24 if a == "a" else 0) for a in SERVERS]
    assert "a" not in addrs(f.filter(other, cands))
    assert f.stats.bounded == 1 and f.stats.header_growth == 1, f.stats


def test_with_the_prior_a_new_groups_first_repeats_stay_once_the_fleet_is_one_shot():
    """`uncontinuedPrior`: once `_PRIOR_MIN` first turns went uncontinued and none came
    back, a new group's repeat, before its own first request's horizon, is kept too; one
    continuation anywhere ends it."""
    clock = ManualClock()
    f = BoundedSessionsFilter(BoundedSessionsFilter.Params(uncontinued_prior=True), clock=clock)
    assert f.sessions.sessions_come_back("chat") is None
    other = [
        dataclasses.replace(req(tokens=64 * 31), block_keys=tuple(range(500 * g, 500 * g + 31)))
        for g in range(1, 9)
    ]
    for r in other:  # 8 other groups' first requests, never continued
        on(f, r, "d", holding())
    clock.advance(2.0)
    f.sessions.settle()
    assert f.sessions.sessions_come_back("chat") is False
    on(f, ask(0), "a", holding())
    clock.advance(0.5)  # within ask(0)'s own horizon: nothing recorded under SHARED
    assert f.filter(ask(1), holding("a")) == holding("a")
    assert f.stats.uncontinued_prior == 1 and f.stats.kept_together == 1
    # One first turn comes back: new prefixes are bounded as before.
    nxt = (*other[0].block_keys, 99_999)
    f.sessions.touch(f.sessions.find(nxt), "d", nxt)
    assert f.sessions.sessions_come_back("chat") is True
    # Bounded (d, carrying 8 of the 9 live sessions, is removed), growth unknown.
    assert addrs(f.filter(ask(2), holding("a"))) == ["a", "b", "c"]
    assert f.stats.growth_unknown == 1 and f.stats.bounded == 1


def test_the_prior_is_off_by_default_and_says_nothing_early():
    assert not BoundedSessionsFilter.Params().uncontinued_prior
    clock = ManualClock()
    live = sessions(clock, uncontinued_prior=True)
    for q in range(7):  # fewer than _PRIOR_MIN fates known
        live.touch(None, "a", ask(q).block_keys)
    clock.advance(2.0)
    live.settle()
    assert live.uncontinued_learned == 7 and live.sessions_come_back() is None
    assert sessions(clock).sessions_come_back() is None
