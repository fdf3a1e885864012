"""The bench's agents declare tools and call them (issue 14, twenty-fifth session): the sim's
chat template renders the tool definitions and the calls, so the tokens count them, each
turn's tokens extend the previous turn's, and `tools=False` sends the same words as before."""

from __future__ import annotations

import dataclasses
import json
from itertools import pairwise

from extproc.requests.parse import ParseSettings, parse_request
from extproc.sim.sessions import AgenticSpec, build_sessions
from extproc.sim.tokens import SimTokenizer

SPEC = AgenticSpec(sessions=1, turns=3, agent_words=100, result_words=40, seed=2)


def token_ids(tok: SimTokenizer, body: dict) -> tuple[int, ...]:
    r = parse_request("/v1/chat/completions", {}, json.dumps(body).encode(), ParseSettings())
    assert r.prompt is not None
    return tok.prompt_tokens(r.prompt).ids


def test_agent_turns_declare_tools_call_them_and_count_them():
    tok = SimTokenizer()
    (with_tools,) = build_sessions(SPEC)
    (plain,) = build_sessions(dataclasses.replace(SPEC, tools=False))
    last = with_tools[-1].body
    assert last["tools"] and "tools" not in plain[-1].body
    roles = [m["role"] for m in last["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert last["messages"][2]["tool_calls"][0]["id"] == last["messages"][3]["tool_call_id"]
    ids = [token_ids(tok, t.body) for t in with_tools]
    # Every turn holds the previous one whole (a session's tail is its own prefix).
    assert all(b[: len(a)] == a for a, b in pairwise(ids))
    # The tool list and the calls are rendered: more tokens than the same words plain.
    plain_ids = [token_ids(tok, t.body) for t in plain]
    assert len(ids[0]) > len(plain_ids[0]) + 100
    assert len(ids[-1]) - len(ids[0]) > len(plain_ids[-1]) - len(plain_ids[0])
    # The same words either way (the plain agents are the workload before tools).
    assert plain[-1].body["messages"][3]["content"] == last["messages"][3]["content"]
