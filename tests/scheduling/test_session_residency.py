"""bounded-sessions-filter with `forgetEvicted`: a session counts against its server only
while its tail may still be in that server's cache (issue 14, tenants workload: a chat
tenant's finished conversations kept counting for the whole window and pushed the tenant's
new conversations onto servers that then had to compute its prompt again)."""

from __future__ import annotations

import dataclasses

from extproc.core import Decision, InferenceRequest
from extproc.scheduling.plugins.sessions import BoundedSessionsFilter, LiveSessions
from extproc.testing import ManualClock
from tests.scheduling.helpers import cand, req

TENANT = tuple(range(1, 30))  # a tenant's prompt every conversation of it starts with
KV = {"kv_blocks": 100, "kv_block_size": 16}  # 1,600 tokens per server


def chat(conversation: int) -> InferenceRequest:
    own = tuple(1000 * (conversation + 1) + i for i in range(5))
    keys = TENANT + own
    return dataclasses.replace(req(tokens=16 * len(keys)), block_keys=keys)


def test_a_session_stops_counting_once_its_server_wrote_a_cache_since():
    live = LiveSessions(window_s=120.0, max_sessions=100, clock=ManualClock())
    cap = {"a": 1000.0, "b": None}.get
    for c in range(3):
        live.touch(None, "a", chat(c).block_keys)
        live.touch(None, "b", chat(10 + c).block_keys)
    live.wrote("a", 600.0)
    assert live.resident_counts(cap) == {"a": 3, "b": 3}
    live.wrote("a", 400.0)  # 1,000 tokens written on a since its three sessions' turns
    live.wrote("b", 10_000.0)  # b's capacity is unknown: its sessions keep counting
    assert live.resident_counts(cap) == {"b": 3}
    assert live.counts() == {"a": 3, "b": 3}  # still live: a next turn finds its chain
    again = live.find((*chat(0).block_keys, 7))
    assert again is not None
    live.touch(again, "a", (*chat(0).block_keys, 7))  # a next turn: resident again
    assert live.resident_counts(cap) == {"a": 1, "b": 3}


def _conversations(forget: bool) -> list[str]:
    """Eight conversations of one tenant arrive one by one; the tenant's prompt is held by
    a (the index credits it); between two conversations the other tenants' traffic writes
    more than a's cache there. Where does each go?"""
    f = BoundedSessionsFilter(BoundedSessionsFilter.Params(forget_evicted=forget))
    out = []
    for c in range(8):
        r = chat(c)
        cands = [cand("a", prefix=len(TENANT), **KV), *(cand(x, prefix=1, **KV) for x in "bc")]
        kept = f.filter(r, cands)
        chosen = max(kept, key=lambda x: x.prefix_blocks)
        f.observe(r, cands, Decision(endpoints=(chosen.endpoint,)))
        out.append(chosen.endpoint.address)
        f.sessions.wrote("a", 2_000.0)  # other tenants' prompts, placed on a meanwhile
    return out


def test_finished_chats_on_a_turned_over_cache_do_not_push_the_tenant_away():
    assert _conversations(forget=True) == ["a"] * 8


def test_without_it_every_conversation_in_the_window_counts():
    # The bound (1.25 x a third of the live sessions) sends conversations to b and c,
    # which compute the tenant's prompt again.
    assert _conversations(forget=False).count("a") < 8
