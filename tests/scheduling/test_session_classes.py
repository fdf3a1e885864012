"""`uncontinuedPrior` per request class (issue 14, twenty-fifth session): first-turn fates are
kept per class (API, tools declared, media), so agents declaring tools whose first turns come
back stay bounded while tool-less one-shot traffic that never comes back uses the prior; the
class travels with a peer's placements, and a continuation of no known class ends the prior
for every class."""

from __future__ import annotations

import dataclasses

from extproc.core import Api, Decision, InferenceRequest, Prompt
from extproc.scheduling.plugins.session_classes import (
    UNKNOWN_CLASS,
    ClassOutcomes,
    session_class,
)
from extproc.scheduling.plugins.sessions import BoundedSessionsFilter, LiveSessions
from extproc.testing import ManualClock
from tests.scheduling.helpers import addrs, cand, req

TOOLS = Prompt(tools=(b'{"type": "function", "function": {"name": "run"}}',))
SERVERS = "abcd"


SHARED = 29  # blocks of a group's prompt


def first(group: int, q: int = 0, *, tools: bool = False) -> InferenceRequest:
    """Request `q` of a group: its prompt (`SHARED` blocks), then 2 blocks of its own."""
    base = 1000 * group
    keys = (*range(base, base + SHARED), base + 500 + 2 * q, base + 501 + 2 * q)
    r = dataclasses.replace(req(tokens=64 * len(keys)), block_keys=keys)
    return dataclasses.replace(r, prompt=TOOLS) if tools else r


def later(r: InferenceRequest) -> InferenceRequest:
    """`r`'s next turn: `r` whole and one block more."""
    return dataclasses.replace(r, block_keys=(*r.block_keys, -r.block_keys[0] - 1))


def holding(*holders: str):
    return [cand(a, prefix=SHARED if a in holders else 0) for a in SERVERS]


def on(f: BoundedSessionsFilter, r: InferenceRequest, endpoint: str) -> None:
    f.observe(r, holding(), Decision(endpoints=(cand(endpoint).endpoint,)))


def test_a_requests_class_is_its_api_tools_and_media():
    assert session_class(req()) == "chat"
    assert session_class(dataclasses.replace(req(), prompt=TOOLS)) == "chat+tools"
    assert session_class(req(media=("ab",))) == "chat+media"
    anthropic = dataclasses.replace(req(media=("ab",)), api=Api.MESSAGES, prompt=TOOLS)
    assert session_class(anthropic) == "messages+tools+media"
    assert session_class(dataclasses.replace(req(), prompt=Prompt())) == "chat"


def test_a_tools_class_that_comes_back_stays_bounded_while_tool_less_one_shots_use_the_prior():
    clock = ManualClock()
    f = BoundedSessionsFilter(BoundedSessionsFilter.Params(uncontinued_prior=True), clock=clock)
    # 8 tool-less groups' first requests, never continued; 8 agents' first turns, each
    # continued 1 s later.
    for g in range(8):
        on(f, first(g), "d")
        on(f, first(100 + g, tools=True), "d")
    clock.advance(1.0)
    for g in range(8):
        agent = later(first(100 + g, tools=True))
        on(f, agent, "d")
    clock.advance(3.5)  # past the horizon, 4 x the 1 s the agents took to come back
    f.sessions.settle()
    assert f.sessions.sessions_come_back("chat") is False
    assert f.sessions.sessions_come_back("chat+tools") is True
    # A new tool-less group's repeat (its own first within its horizon) stays with its
    # holder: the prior for its class.
    on(f, first(50), "a")
    assert f.filter(first(50, 1), holding("a")) == holding("a")
    assert f.stats.uncontinued_prior == 1
    # A new agent session on a new agent prompt is bounded (d, carrying 16 other sessions,
    # is removed): its class comes back.
    on(f, first(200, tools=True), "a")
    assert "d" not in addrs(f.filter(first(200, 1, tools=True), holding("a")))
    assert f.stats.uncontinued_prior == 1 and f.stats.growth_unknown == 1


def test_a_class_with_no_fates_of_its_own_is_bounded_as_without_the_prior():
    clock = ManualClock()
    f = BoundedSessionsFilter(BoundedSessionsFilter.Params(uncontinued_prior=True), clock=clock)
    for g in range(8):
        on(f, first(g), "d")
    clock.advance(2.0)
    f.sessions.settle()
    assert f.sessions.sessions_come_back("chat") is False
    # The first agents ever seen: the one-shot traffic does not speak for them.
    assert f.sessions.sessions_come_back("chat+tools") is None
    on(f, first(200, tools=True), "a")
    assert "d" not in addrs(f.filter(first(200, 1, tools=True), holding("a")))
    assert f.stats.uncontinued_prior == 0 and f.stats.growth_unknown == 1


def test_the_class_travels_with_a_peers_placement_and_an_unknown_one_ends_every_prior():
    clock = ManualClock()
    a, b = (
        LiveSessions(120.0, 1000, clock, learn_growth=True, learn_uncontinued=True,
                     uncontinued_prior=True)
        for _ in "ab"
    )  # fmt: skip
    published: list = []
    a.on_touch = b.on_touch = published.append
    for g in range(8):  # b's own tool-less one-shots
        b.touch(None, "y", first(g).block_keys, "chat")
    a.touch(None, "x", first(100, tools=True).block_keys, "chat+tools")
    assert published[-1][-1] == "chat+tools"
    b.apply(published.pop())
    clock.advance(2.5)
    b.settle()
    assert b.sessions_come_back("chat") is False
    # b places the agent's next turn: a continuation of the class a sent.
    nxt = later(first(100, tools=True)).block_keys
    b.touch(b.find(nxt), "x", nxt)
    assert published[-1][-1] == "chat+tools"
    assert b.sessions_come_back("chat+tools") is True
    assert b.sessions_come_back("chat") is False
    assert b.unclassed_continued == 0
    # A peer too old to send the class: its first turn's continuation counts for every class.
    b.apply(((), "z", first(300).block_keys[-2:], 31, UNKNOWN_CLASS))
    b.apply((first(300).block_keys[-2:], "z", (5, 6), 0, UNKNOWN_CLASS))
    assert b.sessions_come_back("chat") is True
    assert b.unclassed_continued == 1


def test_class_outcomes_stay_small_and_need_their_own_fates():
    fates = ClassOutcomes(keep=4, least=2)
    fates.add("chat", False)
    assert fates.come_back("chat") is None
    fates.add("chat", False)
    assert fates.come_back("chat") is False
    fates.add("chat", True)
    assert fates.come_back("chat") is True
    for _ in range(4):  # the continuation leaves the last 4
        fates.add("chat", False)
    assert fates.come_back("chat") is False
    for n in range(100):  # forged classes: the record keeps at most 32
        fates.add(f"forged{n}", False)
    assert len(fates._fates) == 32 and fates.come_back("chat") is None
