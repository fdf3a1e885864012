"""`bounded-sessions-filter` with `growthClass` (issue 14, twenty-fourth session): in a fleet
that also serves one-shot traffic, every one-shot first turn counts as a live session for the
window, so the holder of an agent prompt stays under `(1 + epsilon) x` its share of them and
takes agent after agent (bench_routing's mixed workload: 4-6 of 6 agent sessions on one
server). With the option, a new session on a prefix whose sessions were seen to grow is
bounded against the sessions that grow only."""

from __future__ import annotations

import dataclasses

from extproc.core import Decision, InferenceRequest
from extproc.scheduling.plugins.sessions import BoundedSessionsFilter
from extproc.testing import ManualClock
from tests.scheduling.helpers import addrs, cand, req

AGENT = tuple(range(1, 30))  # the agent prompt: 29 blocks
SERVERS = "abcd"
CLASS = BoundedSessionsFilter.Params(growth_class=True)


def blocks(keys: tuple[int, ...]) -> InferenceRequest:
    return dataclasses.replace(req(tokens=64 * len(keys)), block_keys=keys)


def agent(s: int, turn: int) -> InferenceRequest:
    """Turn `turn` of agent session `s`: the agent prompt, a 2-block task, 20 blocks a turn
    (growth (2 + 20) / 29 = 0.76 past the prompt after one turn: over keepTogetherGrowth)."""
    own = tuple(1000 * (s + 1) + i for i in range(2 + 20 * turn))
    return blocks(AGENT + own)


def on(f: BoundedSessionsFilter, r: InferenceRequest, endpoint: str, cands) -> None:
    f.observe(r, cands, Decision(endpoints=(cand(endpoint).endpoint,)))


def ballast(f: BoundedSessionsFilter, per_server: int) -> None:
    """One-shot first turns of other groups, `per_server` on each server, never continued."""
    for g in range(per_server * len(SERVERS)):
        r = blocks(tuple(range(100_000 * (g + 1), 100_000 * (g + 1) + 31)))
        on(f, r, SERVERS[g % len(SERVERS)], [cand(a) for a in SERVERS])


def first_agent_grew(f: BoundedSessionsFilter, clock: ManualClock) -> None:
    """Agent session 0 starts on a and comes back with a tool result: sessions on the agent
    prompt grow."""
    on(f, agent(0, 0), "a", [cand(a) for a in SERVERS])
    clock.advance(0.5)
    nxt = agent(0, 1)
    cands = [cand(a, prefix=len(agent(0, 0).block_keys) if a == "a" else 0) for a in SERVERS]
    assert f.continues(nxt, cands)
    on(f, nxt, "a", cands)


def start_agents(f: BoundedSessionsFilter, n: int) -> list[str]:
    """Agent sessions 1..n, one after another, each placed on the first endpoint the filter
    keeps (the holders of the prompt listed first, as the scorers would prefer them)."""
    holders = ["a"]
    placed = []
    for s in range(1, n + 1):
        cands = [cand(a, prefix=len(AGENT) if a in holders else 0) for a in SERVERS]
        cands.sort(key=lambda c: -c.prefix_blocks)
        first = agent(s, 0)
        placed.append(addrs(f.filter(first, cands))[0])
        on(f, first, placed[-1], cands)
        holders.append(placed[-1])
    return placed


def test_one_shot_ballast_hides_an_agent_prompts_pile_up_without_the_class():
    clock = ManualClock()
    f = BoundedSessionsFilter(clock=clock)
    ballast(f, 20)
    first_agent_grew(f, clock)
    # a carries 21 of 81 live sessions: within 1.25 x its share it takes all three.
    assert start_agents(f, 3) == ["a", "a", "a"]
    assert f.stats.bounded == 3 and f.stats.class_bounded == 0


def test_with_the_class_agents_are_bounded_against_agents():
    clock = ManualClock()
    f = BoundedSessionsFilter(CLASS, clock=clock)
    ballast(f, 20)
    first_agent_grew(f, clock)
    # Agent 0 (continued) is the only growing session (the ballast's first turns were
    # placed on a prefix nobody held, never bounded): a is over its share of 2 and removed;
    # each agent placed counts in the class from its first turn, so the next goes to a
    # server without one.
    assert start_agents(f, 3) == ["b", "c", "d"]
    s = f.stats
    assert s.bounded == 3 and s.class_bounded == 3 and s.holders_removed >= 1, s
    assert f.sessions.counts(growing=True) == {"a": 1, "b": 1, "c": 1, "d": 1}
    # The one-shot ballast still counts for everything else.
    assert sum(f.sessions.counts().values()) == 80 + 4


def test_the_class_leaves_unknown_growth_and_header_records_to_the_whole_count():
    """A prefix no session was seen continued on (a one-shot group's early repeat, or an
    agent's before its first comes back) is bounded against every live session, as before:
    counting only the recent first turns removed more holders on one-shot traffic (bench/
    RESULTS.md, twenty-third session, oneshot2). Growth read under a header only says nothing
    of this prompt's sessions: the whole count too."""
    clock = ManualClock()
    f = BoundedSessionsFilter(CLASS, clock=clock)
    ballast(f, 20)
    on(f, agent(0, 0), "a", [cand(a) for a in SERVERS])
    clock.advance(0.5)
    cands = [cand(a, prefix=len(AGENT) if a == "a" else 0) for a in SERVERS]
    assert f.filter(agent(1, 0), cands) == cands  # unknown growth: a passes among 81
    assert f.stats.growth_unknown == 1 and f.stats.class_bounded == 0
    first_agent_grew(f, clock)
    header = AGENT[:6]
    other = blocks(header + tuple(range(70_000, 70_040)))
    cands = [cand(a, prefix=len(header) if a == "a" else 0) for a in SERVERS]
    assert f.filter(other, cands) == cands
    assert f.stats.header_growth == 1 and f.stats.class_bounded == 0, f.stats


def test_sessions_of_unknown_growth_join_the_class_until_judged_one_shot():
    """Agent sessions placed before the first came back count when later ones are bounded;
    a one-shot group's early repeat leaves the class once its horizon passed uncontinued."""
    clock = ManualClock()
    f = BoundedSessionsFilter(CLASS, clock=clock)
    ballast(f, 20)
    on(f, agent(0, 0), "a", [cand(a) for a in SERVERS])
    cands = [cand(a, prefix=len(AGENT) if a == "a" else 0) for a in SERVERS]
    early = agent(1, 0)
    assert f.filter(early, cands) == cands  # unknown growth: bounded against all, a passes
    on(f, early, "a", cands)
    assert f.sessions.counts(growing=True) == {"a": 1}
    clock.advance(0.5)
    nxt = agent(0, 1)
    cands = [cand(a, prefix=len(agent(0, 0).block_keys) if a == "a" else 0) for a in SERVERS]
    on(f, nxt, "a", cands)
    assert f.sessions.counts(growing=True) == {"a": 2}
    # Agent 1 never comes back: past the 2 s floor it was one-shot after all.
    clock.advance(2.0)
    f.sessions.settle()
    assert f.sessions.counts(growing=True) == {"a": 1}
    assert sum(f.sessions.counts().values()) == 80 + 2


def test_continued_sessions_and_peers_later_turns_join_the_class():
    f = BoundedSessionsFilter(CLASS)
    live = f.sessions
    live.touch(None, "a", (1, 2, 3))
    assert live.counts(growing=True) == {}
    live.touch(live.find((1, 2, 3, 4)), "a", (1, 2, 3, 4))
    assert live.counts(growing=True) == {"a": 1}
    # A peer's new session, then its later turn whose first turn this replica never saw.
    live.apply(((), "b", (7, 8), 2))
    live.apply(((50, 51), "c", (52, 53), 2))
    assert live.counts(growing=True) == {"a": 1, "c": 1}
    assert live.counts() == {"a": 1, "b": 1, "c": 1}


def test_growth_class_is_off_by_default():
    assert not BoundedSessionsFilter.Params().growth_class
