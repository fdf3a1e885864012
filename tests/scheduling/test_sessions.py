"""Live sessions on crafted requests: a new session is bounded by the sessions each server
already carries (not by in-flight requests, which idle agentic sessions do not show), a later
turn is recognised by its own tail and kept home."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import msgspec

from extproc.core import Candidate, Decision, InferenceRequest
from extproc.scheduling.config import build_scheduler, default_config
from extproc.scheduling.plugins.sessions import (
    BoundedSessionsFilter,
    LiveSessions,
    SessionTailScorer,
    session_bound,
)
from extproc.scheduling.plugins.ttft import BoundedLoadFilter
from extproc.testing import ManualClock, plugin_registry
from tests.scheduling.helpers import addrs, cand, req

SHARED = tuple(range(1, 30))  # an agent prompt every session starts with


def turn(session: int, n: int) -> InferenceRequest:
    """Turn `n` of `session`: the shared prompt, then 5 blocks of its own per turn."""
    own = tuple(1000 * (session + 1) + i for i in range(5 * (n + 1)))
    return dataclasses.replace(req(tokens=64 * (len(SHARED) + len(own))), block_keys=SHARED + own)


def held(session: int, n: int) -> int:
    """Blocks of turn `n + 1` the server that took turn `n` holds (its whole prompt)."""
    return len(turn(session, n).block_keys)


def place(f: BoundedSessionsFilter, r: InferenceRequest, cands: Sequence[Candidate]) -> str:
    """Filter, then send to the first survivor holding the most (as a cache scorer would)."""
    kept = f.filter(r, cands)
    chosen = max(kept, key=lambda c: c.prefix_blocks)
    f.observe(r, cands, Decision(endpoints=(chosen.endpoint,)))
    return chosen.endpoint.address


def test_new_sessions_on_a_shared_prompt_spread_evenly_and_turns_stay_home():
    f = BoundedSessionsFilter(BoundedSessionsFilter.Params(epsilon=0.0))
    home: dict[int, str] = {}
    for s in range(6):
        # Every server but the first holder looks equally attractive to a cache scorer: the
        # first to place holds the shared prompt; in-flight counts are 0 everywhere.
        cands = [cand(a, prefix=len(SHARED) if a in home.values() else 0) for a in "abc"]
        home[s] = place(f, turn(s, 0), cands)
    assert sorted(home.values()) == ["a", "a", "b", "b", "c", "c"]
    assert f.sessions.counts() == {"a": 2, "b": 2, "c": 2}
    # Later turns continue their chains: never filtered, counted once.
    for s in range(6):
        r = turn(s, 1)
        cands = [cand(a, prefix=held(s, 0) if a == home[s] else 0) for a in "abc"]
        assert f.continues(r, cands) and f.home(r, cands) == home[s]
        assert f.filter(r, cands) == cands
        f.observe(r, cands, Decision(endpoints=(cand(home[s]).endpoint,)))
    assert f.sessions.counts() == {"a": 2, "b": 2, "c": 2}


def test_default_tolerance_leaves_no_server_without_a_session():
    """Issue 14, agentic: 8 sessions on one agent prompt, 4 servers, the default epsilon. The
    bound rounded up let the prompt's holders take a second and third session while one
    server had none (3/3/2/0); now the fourth session goes to the empty server."""
    f = BoundedSessionsFilter()
    home: dict[int, str] = {}
    for s in range(8):
        cands = [cand(a, prefix=len(SHARED) if a in home.values() else 0) for a in "abcd"]
        home[s] = place(f, turn(s, 0), cands)
        if s == 3:
            assert sorted(home.values()) == ["a", "b", "c", "d"]
    assert f.sessions.counts() == {"a": 2, "b": 2, "c": 2, "d": 2}


def test_session_bound_keeps_epsilon_and_always_leaves_room():
    assert session_bound(1.0, 0.25) == 1  # ceil(1.25) would be 2: +100%
    assert session_bound(1.25, 0.25) == 2  # never under the fair share rounded up
    assert session_bound(2.0, 0.25) == 2
    assert session_bound(4.0, 0.25) == 5
    assert session_bound(10.0, 0.25) == 12
    assert session_bound(0.2, 0.0) == 1
    assert session_bound(3.0, 0.0) == 3  # float error does not add a session


def test_capacity_shares_weigh_the_bound():
    f = BoundedSessionsFilter(BoundedSessionsFilter.Params(epsilon=0.0))
    big = {"kv_blocks": 3000, "kv_block_size": 16}
    small = {"kv_blocks": 1000, "kv_block_size": 16}
    placed = []
    for s in range(8):
        cands = [cand("big", prefix=29, **big), cand("small", **small)]
        placed.append(place(f, turn(s, 0), cands))
    assert placed.count("big") == 6 and placed.count("small") == 2


def test_sessions_expire_and_a_moved_session_counts_where_it_went():
    clock = ManualClock()
    sessions = LiveSessions(window_s=10.0, max_sessions=100, clock=clock)
    sessions.touch(None, "a", turn(0, 0).block_keys)
    sessions.touch(None, "a", turn(1, 0).block_keys)
    chain = sessions.find(turn(0, 1).block_keys, [held(0, 0)])
    assert chain is not None and sessions.find(turn(2, 0).block_keys, [len(SHARED)]) is None
    sessions.touch(chain, "b", turn(0, 1).block_keys)  # moved: one session each
    assert sessions.counts() == {"a": 1, "b": 1}
    clock.advance(11.0)
    assert sessions.counts() == {} and len(sessions) == 0


def test_the_record_is_bounded():
    sessions = LiveSessions(window_s=1e9, max_sessions=3)
    for s in range(10):
        sessions.touch(None, "a", turn(s, 0).block_keys)
    assert len(sessions) == 3 and sessions.counts() == {"a": 3}
    assert sessions.find(turn(0, 1).block_keys, [held(0, 0)]) is None  # the oldest forgotten


def test_tail_scorer_keeps_a_later_turn_home_and_has_no_opinion_on_new_sessions():
    f = BoundedSessionsFilter()
    scorer = SessionTailScorer()
    scorer.bind({"f": f})
    cands = [cand(a) for a in "abc"]
    assert scorer.score(turn(0, 0), cands) == [1.0, 1.0, 1.0]
    f.observe(turn(0, 0), cands, Decision(endpoints=(cands[1].endpoint,)))
    later = [cand(a, prefix=held(0, 0) if a == "b" else 0) for a in "abc"]
    assert scorer.score(turn(0, 1), later) == [0.0, 1.0, 0.0]
    # Its home filtered out (or gone): no preference among the rest.
    assert scorer.score(turn(0, 1), [later[0], later[2]]) == [1.0, 1.0]


def test_tail_scorer_lets_go_once_the_home_has_evicted_the_tail():
    """A chat's next turn whose home no longer holds more of it than elsewhere (the index
    dropped the tail: that cache turned over) has nothing to lose by moving: no preference,
    so predicted TTFT may send it to an idle server instead of queueing a full recompute."""
    f = BoundedSessionsFilter()
    scorer = SessionTailScorer()
    scorer.bind({"f": f})
    cands = [cand(a, prefix=len(SHARED)) for a in "abc"]
    f.observe(turn(0, 0), cands, Decision(endpoints=(cands[1].endpoint,)))
    # Every server holds the shared prompt, the home nothing more: evicted.
    evicted = [cand(a, prefix=len(SHARED)) for a in "abc"]
    assert f.home(turn(0, 1), evicted) == "b"
    assert scorer.score(turn(0, 1), evicted) == [1.0, 1.0, 1.0]
    # Another server took an identical prompt meanwhile and holds more than the home.
    assert scorer.score(turn(0, 1), [cand("a", prefix=33), cand("b", prefix=31)]) == [1.0, 1.0]
    # The home still ahead by one block: the hysteresis holds.
    kept = [cand("a", prefix=len(SHARED)), cand("b", prefix=len(SHARED) + 1)]
    assert scorer.score(turn(0, 1), kept) == [0.0, 1.0]
    # The index did not answer (a degraded lookup: no prefix known anywhere): no sign of an
    # eviction, so the session record keeps the turn home.
    unknown = [dataclasses.replace(cand(a), prefix_known=False) for a in "abc"]
    assert f.home(turn(0, 1), unknown) == "b"
    assert scorer.score(turn(0, 1), unknown) == [0.0, 1.0, 0.0]


def test_bounded_load_leaves_later_turns_to_the_scorers():
    f = BoundedSessionsFilter()
    load = BoundedLoadFilter()
    load.bind({"sessions": f, "load": load})
    busy = [cand("a", inflight_requests=6), cand("b"), cand("c")]
    first = turn(0, 0)
    assert addrs(load.filter(first, busy)) == ["b", "c"]  # a new session: bounded
    f.observe(first, busy, Decision(endpoints=(busy[0].endpoint,)))
    busy[0] = cand("a", inflight_requests=6, prefix=held(0, 0))
    assert addrs(load.filter(turn(0, 1), busy)) == ["a", "b", "c"]  # its next turn: not


def test_default_profile_builds_them_bound_together():
    scheduler = build_scheduler(default_config(), plugin_registry())
    (profile,) = scheduler.profiles.values()
    assert profile.filters[0].name == "bounded-sessions-filter"
    assert ("session-tail-scorer", 2.0) in [(s.name, s.weight) for s in profile.scorers]


def test_a_prefix_nobody_holds_is_left_to_the_load_scorers():
    f = BoundedSessionsFilter()
    for s in range(4):
        f.observe(turn(s, 0), [], Decision(endpoints=(cand("a").endpoint,)))
    cold = [cand("a"), cand("b")]
    assert addrs(f.filter(turn(9, 0), cold)) == ["a", "b"]  # no holder: not a group joiner
    warm = [cand("a", prefix=29), cand("b")]
    assert addrs(f.filter(turn(9, 0), warm)) == ["b"]
    # A degraded lookup (the index did not answer): nothing is known to be unheld, so the
    # new session is bounded as one on a shared prompt would be.
    blind = [dataclasses.replace(c, prefix_known=False) for c in cold]
    assert addrs(f.filter(turn(9, 0), blind)) == ["b"]


def test_bounded_load_counts_a_servers_scraped_queue():
    load = BoundedLoadFilter()
    # b finished its placements (held in flight until the access log says so); a is busy
    # with another client's work the pickers never placed.
    cands = [cand("a", running=2, waiting=10), cand("b", inflight_requests=2)]
    assert addrs(load.filter(req(blocks=3), cands)) == ["b"]  # 12 > 1.25 x 15 / 2 + 1
    stale = [cand("a", running=2, waiting=10, age_s=None), cand("b", inflight_requests=2)]
    assert addrs(load.filter(req(blocks=3), stale)) == ["a", "b"]  # old figures: not counted


def test_a_continuation_is_found_near_the_match_only():
    sessions = LiveSessions(window_s=1e9, max_sessions=100)
    sessions.touch(None, "a", turn(0, 3).block_keys)
    later = turn(0, 80).block_keys  # 434 blocks; the tail of turn 3 is block 48
    assert sessions.find(later, []) is None  # beyond the scan of the last 256 blocks
    assert sessions.find(turn(0, 40).block_keys, []) is not None  # 234 blocks: within it
    assert sessions.find(later, [0.0, 49.0]) is not None  # the approximate index's match
    # Precise keys: the engine cached the previous answer too (the match runs past the tail),
    # or a lower tier weighs the match down (rounded up; the tail is one block back).
    assert sessions.find(later, [49 + 40]) is not None
    assert sessions.find(later, [48.4]) is not None
    # Far past the tail (another session's longer match): out of the probe's reach.
    assert sessions.find(later, [49 + 70]) is None
    assert sessions.find(later, [49 + 70, 49]) is not None


def test_a_peer_placement_continues_the_same_chain_here():
    a, b = (LiveSessions(window_s=10.0, max_sessions=100, clock=ManualClock()) for _ in "ab")
    published: list = []
    a.on_touch = published.append
    b.on_touch = published.append
    a.touch(None, "x", turn(0, 0).block_keys)  # replica a starts the session
    b.apply(published.pop())
    chain = b.find(turn(0, 1).block_keys, [held(0, 0)])
    assert chain is not None
    b.touch(chain, "y", turn(0, 1).block_keys)  # replica b places its next turn elsewhere
    a.apply(published.pop())
    assert a.counts() == b.counts() == {"y": 1}
    assert a.endpoint(a.find(turn(0, 2).block_keys, [held(0, 1)])) == "y"


def grown(session: int, n: int, per_turn: int) -> InferenceRequest:
    """Turn `n` of `session` adding `per_turn` blocks of its own each turn after SHARED."""
    own = tuple(1000 * (session + 1) + i for i in range(per_turn * (n + 1)))
    return dataclasses.replace(req(tokens=64 * (len(SHARED) + len(own))), block_keys=SHARED + own)


TOGETHER = BoundedSessionsFilter.Params(keep_together_growth=0.5)


def run_group(f: BoundedSessionsFilter, sessions: int, servers: str, per_turn: int) -> list[str]:
    """New sessions on SHARED, each continued once before the next starts (as a chat's
    second turn, or an agent's next tool turn, comes back meanwhile); the first session's
    server holds SHARED from then on. Returns where each session started."""
    placed: list[str] = []
    for s in range(sessions):
        cands = [cand(a, prefix=len(SHARED) if a in placed else 0) for a in servers]
        placed.append(place(f, grown(s, 0, per_turn), cands))
        nxt = grown(s, 1, per_turn)
        held_by = len(grown(s, 0, per_turn).block_keys)
        cands = [cand(a, prefix=held_by if a == placed[s] else 0) for a in servers]
        assert f.continues(nxt, cands) and f.filter(nxt, cands) == cands
        f.observe(nxt, cands, Decision(endpoints=(cand(placed[s]).endpoint,)))
    return placed


def test_chat_sessions_that_stay_small_are_not_spread_off_their_prompts_holder():
    """Issue 14, tenants: a tenant's conversations end after two turns having added a fifth
    of the tenant prompt they share; bounding them as sessions wrote big tenants' prompts onto
    five or six servers. Once one conversation has shown it stays small, the group's new
    conversations are left to the scorers (here: the holder of the prompt)."""
    f = BoundedSessionsFilter(TOGETHER)
    placed = run_group(f, 8, "abcd", per_turn=2)  # 4 blocks past 29 shared
    growth = f.sessions.growth(grown(8, 0, 2).block_keys, len(SHARED))
    assert growth is not None and growth < 0.5
    # The first conversation (nothing held) taught, once continued, that conversations on
    # this prompt stay small: every later one joins the prompt's holder, where the bound
    # alone writes the prompt on all four servers.
    assert placed == [placed[0]] * 8, placed


def test_agent_sessions_that_grow_still_spread_evenly():
    """Agent sessions add more than half the shared prompt per tool turn: their group is
    bounded whatever has been learned about it, 2/2/2/2 on four servers."""
    f = BoundedSessionsFilter(TOGETHER)
    placed = run_group(f, 8, "abcd", per_turn=10)  # 20 blocks past 29 shared: 0.69
    assert (f.sessions.growth(grown(8, 0, 10).block_keys, len(SHARED)) or 0.0) > 0.5
    assert sorted(placed) == ["a", "a", "b", "b", "c", "c", "d", "d"], placed


def test_by_default_sessions_that_grow_are_bounded_and_chats_are_not():
    assert BoundedSessionsFilter.Params().keep_together_growth == 0.5
    assert BoundedSessionsFilter.Params().share_growth  # with a Redis index (shared_growth)
    chat = run_group(BoundedSessionsFilter(), 8, "abcd", per_turn=2)
    assert chat == [chat[0]] * 8, chat
    agent = run_group(BoundedSessionsFilter(), 8, "abcd", per_turn=10)
    assert sorted(agent) == ["a", "a", "b", "b", "c", "c", "d", "d"], agent


def test_keep_together_off_bounds_every_group():
    f = BoundedSessionsFilter(BoundedSessionsFilter.Params(keep_together_growth=0.0))
    placed = run_group(f, 8, "abcd", per_turn=2)
    assert sorted(placed) == ["a", "a", "b", "b", "c", "c", "d", "d"], placed
    assert f.stats.kept_together == 0 and f.stats.growth_unknown == 0
    # Sessions 2-8 were bounded (the first found nothing held); the second found its only
    # holder over the bound, and its prompt went to a server without it.
    assert f.stats.bounded == 7 and f.stats.holders_removed >= 1, f.stats


HEADER = tuple(range(1, 9))  # a chat template's first block(s), the same for every tenant


def conversation(tenant: int, conv: int, turn: int) -> InferenceRequest:
    """Turn `turn` of conversation `conv` of `tenant`: the shared header, the tenant's own
    24-block prompt, then 2 blocks of the conversation's own per turn."""
    prompt = HEADER + tuple(100_000 * (tenant + 1) + i for i in range(24))
    own = tuple(100_000 * (tenant + 1) + 1000 * (conv + 1) + i for i in range(2 * (turn + 1)))
    return dataclasses.replace(req(tokens=64 * (len(prompt) + len(own))), block_keys=prompt + own)


def test_a_big_tenants_early_conversations_stay_with_its_prompt_before_any_came_back():
    """Issue 14, tenants at 24 req/s: the biggest tenant's next conversations arrive before
    its first one's second turn, so nothing learned under the tenant's own prompt says they
    stay small. Growth is kept in blocks and read at the longest recorded prefix: what other
    tenants' conversations on the shared header showed (two blocks past their first turn)
    applies to this tenant's prompt too, and its conversations stay with its holder. Kept
    as a fraction of the exact prefix (before the sixteenth session), nothing was known
    under the tenant's prompt and the bound dealt them out 2/2/2/2."""
    f = BoundedSessionsFilter(TOGETHER)
    servers = "abcd"
    held: dict[str, float] = {}  # server -> blocks of tenant 1's conversations it holds
    for conv in range(4):  # tenant 0's conversations, each continued (they teach growth)
        first = conversation(0, conv, 0)
        at = place(f, first, [cand(a, prefix=len(HEADER)) for a in servers])
        nxt = conversation(0, conv, 1)
        cands = [cand(a, prefix=len(first.block_keys) if a == at else 0) for a in servers]
        f.observe(nxt, cands, Decision(endpoints=(cand(at).endpoint,)))
    before = dataclasses.replace(f.stats)
    placed = []
    for conv in range(8):  # tenant 1: eight conversations, none continued yet
        r = conversation(1, conv, 0)
        cands = [cand(a, prefix=held.get(a, len(HEADER))) for a in servers]
        placed.append(place(f, r, cands))
        held[placed[-1]] = 32  # its prompt (header and tenant blocks) is cached there
    assert placed[1:] == [placed[1]] * 7, placed
    # The first found nothing of the tenant's prompt (bounded on the header); the other
    # seven were left to the scorers on what tenant 0's conversations showed.
    assert f.stats.kept_together - before.kept_together == 7
    assert f.stats.growth_unknown == before.growth_unknown


SHORT_HEADER = tuple(range(1, 7))  # 6 blocks: the bench's tenants' header, under the stride


def short_header_conversation(tenant: int, conv: int, turn: int) -> InferenceRequest:
    """As `conversation`, on a 6-block header (shorter than the 8-block stride)."""
    prompt = SHORT_HEADER + tuple(100_000 * (tenant + 1) + i for i in range(24))
    own = tuple(100_000 * (tenant + 1) + 1000 * (conv + 1) + i for i in range(2 * (turn + 1)))
    return dataclasses.replace(req(tokens=64 * (len(prompt) + len(own))), block_keys=prompt + own)


def test_growth_learned_on_a_header_shorter_than_the_stride_reaches_other_tenants():
    """Issue 14, tenants: the header every tenant shares is 6 approximate blocks, and growth
    recorded only under every 8th block was filed under keys inside each tenant's own
    prompt, where another tenant never looks: 59-68 of 66-69 bounded sessions a run had no
    growth to read (sixteenth session). Recorded under each of the first blocks too, tenant
    0's continued conversations teach tenant 1's first ones, read at the header (counted)."""
    f = BoundedSessionsFilter(TOGETHER)
    servers = "abcd"
    for conv in range(2):  # tenant 0's conversations, each continued
        first = short_header_conversation(0, conv, 0)
        at = place(f, first, [cand(a, prefix=len(SHORT_HEADER)) for a in servers])
        nxt = short_header_conversation(0, conv, 1)
        cands = [cand(a, prefix=len(first.block_keys) if a == at else 0) for a in servers]
        f.observe(nxt, cands, Decision(endpoints=(cand(at).endpoint,)))
    learned = f.sessions.learned(short_header_conversation(1, 0, 0).block_keys, 30)
    assert learned == (2, len(SHORT_HEADER))  # 2 blocks past the first turn, under the header
    before = dataclasses.replace(f.stats)
    held: dict[str, float] = {}
    placed = []
    for conv in range(6):  # tenant 1: none continued yet
        r = short_header_conversation(1, conv, 0)
        cands = [cand(a, prefix=held.get(a, len(SHORT_HEADER))) for a in servers]
        placed.append(place(f, r, cands))
        held[placed[-1]] = 30
    assert placed[1:] == [placed[1]] * 5, placed
    # The first found only the header held (its own part is 4x it: bounded, as it should
    # be); the other five, holding the tenant's prompt, stayed small beside it.
    assert f.stats.kept_together - before.kept_together == 5
    assert f.stats.header_growth - before.header_growth == 6
    assert f.stats.growth_unknown == before.growth_unknown
    # The tenant's own prompt, once one of its conversations is continued, is read first.
    f.observe(
        short_header_conversation(1, 0, 1),
        [cand(placed[0], prefix=32)],
        Decision(endpoints=(cand(placed[0]).endpoint,)),
    )
    assert f.sessions.learned(short_header_conversation(1, 9, 0).block_keys, 30) == (2, 24)


def test_a_header_record_does_not_keep_together_sessions_that_grow():
    """The header-level record is the most any session on the header grew: an agent session
    that grew past half its prompt bounds the next ones on that header, whatever chats
    showed there before."""
    sessions = LiveSessions(120.0, 100, ManualClock(), learn_growth=True)
    chat, agent = short_header_conversation(0, 0, 0), short_header_conversation(1, 0, 0)
    sessions.touch(None, "a", chat.block_keys)
    sessions.touch(
        sessions.find(chat.block_keys), "a", short_header_conversation(0, 0, 1).block_keys
    )
    sessions.touch(None, "b", agent.block_keys)
    sessions.touch(sessions.find(agent.block_keys), "b", agent.block_keys + tuple(range(-40, 0)))
    assert sessions.learned(short_header_conversation(2, 0, 0).block_keys, 30) == (40, 6)
    assert (sessions.growth(short_header_conversation(2, 0, 0).block_keys, 30) or 0.0) > 0.5


def test_learned_growth_survives_a_bytes_per_token_recalibration():
    """Calibration's change of bytes per token (4 -> 1 in the bench, 1.5-2.2 s into a run)
    pins the key geometry: the same text keeps its block keys, so growth learned before the
    change is read after it (the sixteenth session thought it dropped)."""
    from extproc.calibration import Calibration
    from extproc.requests.settings import ParseSettings

    cal = Calibration(ParseSettings(block_tokens=16, bytes_per_token=4))

    def chat(*turns: str) -> InferenceRequest:
        messages = [{"role": "system", "content": "header " * 40 + "tenant prompt " * 60}]
        for i, text in enumerate(turns):
            messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
        body = msgspec.json.encode({"model": "m", "messages": messages})
        return cal("/v1/chat/completions", {}, body)

    sessions = LiveSessions(120.0, 100, ManualClock(), learn_growth=True)
    first = chat("question one " * 10)
    sessions.touch(None, "a", first.block_keys)
    second = chat("question one " * 10, "answer " * 30, "more " * 10)
    sessions.touch(sessions.find(second.block_keys), "a", second.block_keys)
    new = chat("question two " * 10)
    before = sessions.learned(new.block_keys, len(first.block_keys) - 3)
    assert before is not None
    assert cal.adopt(1, 4, source="test") and cal.settings.bytes_per_token == 1
    after = chat("question two " * 10)
    assert after.block_keys == new.block_keys
    assert sessions.learned(after.block_keys, len(first.block_keys) - 3) == before


def test_a_later_turn_placed_on_another_replica_teaches_growth_there_when_shared():
    """Issue 14, three replicas: a session's first-turn length rides on the shared placement,
    so the replica placing its next turn learns how far it grew (and, with `shareGrowth`,
    publishes the records that rose); without it only the replica that placed the first turn
    learns (as before the nineteenth session)."""
    for share in (True, False):
        a, b = (
            LiveSessions(10.0, 100, ManualClock(), learn_growth=True, share_growth=share)
            for _ in "ab"
        )
        published: list = []
        grown_b: list = []
        a.on_touch = published.append
        b.on_grown = grown_b.append
        a.touch(None, "x", turn(0, 0).block_keys)  # replica a places the first turn
        assert published[-1][3] == len(turn(0, 0).block_keys)
        b.apply(published.pop())
        nxt = turn(0, 1).block_keys
        b.touch(b.find(nxt, [held(0, 0)]), "x", nxt)  # replica b places the next turn
        learned = b.learned(turn(1, 0).block_keys, len(SHARED))
        if share:
            assert learned is not None and learned[0] == 5  # 5 blocks past its first turn
            # Published once, under the first 7 blocks and every 8th of the first turn.
            assert grown_b == [(5, (*SHARED[:7], SHARED[7], SHARED[15], SHARED[23], 1002))]
            b.touch(b.find(turn(0, 1).block_keys, [held(0, 1)]), "x", nxt)
            assert len(grown_b) == 1  # the same growth again: nothing rose, nothing sent
        else:
            assert learned is None and grown_b == []
