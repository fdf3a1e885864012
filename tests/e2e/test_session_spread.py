"""New agentic sessions on one shared agent prompt, through Envoy and `extproc serve` with
the default profile: 8 sessions on 4 servers start 2 per server. The bounded-sessions
bound, rounded up, let the servers already holding the prompt take a second and a third
session while the fourth server had none (issue 14: one server of four idle at the start,
spreads like 34/30/25/7 requests in every mode); recomputing the ~3,000-token prompt once
on that server costs far less than the sessions' tails crowding the others.

Sessions start one after another (each first turn answered before the next is sent), so
the placements do not depend on the machine's speed: only the bound decides.

With `keepTogetherGrowth` (0.5, the default since issue 14's sixteenth session), the bound
is for sessions that grow: chat conversations on a tenant's prompt, each ending after two
short turns, stay with the prompt's holders once one of them has shown it stays small
(issue 14, tenants: the bound wrote big tenants' prompts onto five or six servers), while
agent sessions that grow by a tool result per turn are still bounded."""

from __future__ import annotations

import json
import random
from collections import Counter

import httpx

from extproc.protocol import DECISION_HEADER, EXPLAIN_HEADER
from extproc.sim import SERVED_BY_HEADER
from extproc.stack import Stack, StackOptions

SIM = ("--fast", "4", "--prefill-tps", "5000", "--num-gpu-blocks", "2000")
# Told, as calibration would find: a change of keys mid-test would forget every prefix.
PARSE = "parse: {block_tokens: 16, bytes_per_token: 1}\n"
WORDS = ("plan", "tool", "search", "read", "file", "patch", "test", "result", "error", "diff")
SERVERS = 4
SESSIONS = 8


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def test_new_sessions_fill_every_server_before_any_takes_a_second(tmp_path):
    rng = random.Random(3)
    agent = "You are a coding agent. " + text(rng, 600)
    cfg = tmp_path / "picker.yaml"
    cfg.write_text(PARSE)
    opts = StackOptions(upstreams=SERVERS, sim_args=SIM, extproc_args=("--config", str(cfg)))
    served: list[str] = []
    with Stack(opts) as stack, httpx.Client(timeout=60) as http:
        for s in range(SESSIONS):
            # Each session's task is many blocks long: its tail is its own, not the prompt's.
            task = f"task {s}: " + text(rng, 80)
            body = {
                "model": "tiny",
                "max_tokens": 2,
                "messages": [
                    {"role": "system", "content": agent},
                    {"role": "user", "content": task},
                ],
            }
            r = http.post(f"{stack.url}/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            served.append(r.headers[SERVED_BY_HEADER])
    counts = Counter(served)
    # The first four sessions take one server each, then every server takes a second.
    assert len(set(served[:SERVERS])) == SERVERS, served
    assert sorted(counts.values()) == [SESSIONS // SERVERS] * SERVERS, served


TOKEN = "session-spread-token"


def run_sessions(
    tmp_path, prefix: str, first: list[str], second: list[str]
) -> tuple[list[str], list[list[str]], dict[str, float]]:
    """With the default profile, sessions one after another, each a first turn then a
    second turn carrying the first whole (`first[s]`, then its answer and `second[s]`);
    where each first turn was served, the picker's reasons for it (which filter removed
    which endpoint), and its session-bound counters at the end (by metric name)."""
    cfg = tmp_path / "picker.yaml"
    cfg.write_text(PARSE + f"server: {{explain_tokens: [{TOKEN}]}}\n")
    opts = StackOptions(
        upstreams=SERVERS, sim_args=SIM, extproc_args=("--config", str(cfg)), allow_explain=True
    )
    served: list[str] = []
    reasons: list[list[str]] = []
    with Stack(opts) as stack, httpx.Client(timeout=60) as http:
        for one, two in zip(first, second, strict=True):
            messages = [{"role": "system", "content": prefix}, {"role": "user", "content": one}]
            for content in (None, two):
                if content is not None:
                    messages += [
                        {"role": "assistant", "content": "noted: " + one[:60]},
                        {"role": "user", "content": content},
                    ]
                body = {"model": "tiny", "max_tokens": 2, "messages": messages}
                r = http.post(
                    f"{stack.url}/v1/chat/completions", json=body, headers={EXPLAIN_HEADER: TOKEN}
                )
                assert r.status_code == 200, r.text
                if content is None:
                    served.append(r.headers[SERVED_BY_HEADER])
                    reasons.append(json.loads(r.headers[DECISION_HEADER])["reasons"])
        text = http.get(f"http://127.0.0.1:{stack.picker_admin_port}/metrics").text
    bound = {
        name.removeprefix("extproc_session_bound_").removesuffix("_total"): float(value)
        for line in text.splitlines()
        if line.startswith("extproc_session_bound_") and "_total{" in line
        for name, value in [(line.split("{")[0], line.rsplit(" ", 1)[1])]
    }
    return served, reasons, bound


def test_chat_conversations_that_stay_small_stay_with_their_prompt(tmp_path):
    rng = random.Random(5)
    tenant = "You answer questions about one product. " + text(rng, 400)
    # A question and a follow-up: the second turn grows the conversation by about a
    # sixth of the tenant prompt it shares.
    first = [f"question {s}: " + text(rng, 25) for s in range(SESSIONS)]
    second = [f"follow-up {s}: " + text(rng, 25) for s in range(SESSIONS)]
    served, reasons, bound = run_sessions(tmp_path, tenant, first, second)
    # The first conversation, continued, taught that conversations on this prompt stay
    # small: the session bound removes no holder of the prompt for the later ones (before
    # issue 14's seventh session it removed one from the second conversation on, writing
    # the prompt on all four servers). In-flight load may still move one (its own filter).
    bounded = [r for rs in reasons for r in rs if r.startswith("default/bounded-sessions-filter")]
    assert bounded == [], (served, reasons)
    # Conversations 2-8 were left to the scorers, and the picker says so.
    assert bound["kept_together"] == SESSIONS - 1, bound


def test_agent_sessions_that_grow_still_start_two_per_server(tmp_path):
    rng = random.Random(7)
    agent = "You are a coding agent. " + text(rng, 600)
    # Each session's next turn adds a tool result over half the agent prompt's length.
    first = [f"task {s}: " + text(rng, 80) for s in range(SESSIONS)]
    second = [f"tool result {s}: " + text(rng, 450) for s in range(SESSIONS)]
    served, reasons, bound = run_sessions(tmp_path, agent, first, second)
    # Sessions 1-3 each find every server carrying a session over the bound (a fair share
    # under one): the bound removes the prompt's holders though the first session, continued,
    # has been seen to grow. (Whether a later turn stays home is the scorers' call, timing
    # dependent here, so where sessions end up is not asserted.)
    for s in (1, 2, 3):
        assert any(r.startswith("default/bounded-sessions-filter") for r in reasons[s]), (
            served,
            reasons,
        )
    assert bound["kept_together"] == 0 and bound["bounded"] >= 3, bound
