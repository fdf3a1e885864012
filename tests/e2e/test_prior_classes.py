"""`uncontinuedPrior` per request class through Envoy and `extproc serve` (issue 14,
twenty-fifth session): eight tool-less one-shot prompts go unanswered by any later turn while
an agent declaring tools comes back for its second turn. Past the horizon (the 2 s floor),
a new tool-less prompt group's repeat is read as one-shot by its class's prior and left to
the scorers, while a second session on a new agent prompt declaring tools is bounded: its
class's first turns come back. With the fleet's outcomes in one record (before), the agent's
continuation ended the prior for everyone and the tool-less repeat was bounded too."""

from __future__ import annotations

import json
import random
import time

import httpx

from extproc.protocol import DECISION_HEADER, EXPLAIN_HEADER
from extproc.stack import Stack, StackOptions
from tests.e2e.profiles import default_profile_with

SIM = ("--fast", "4", "--prefill-tps", "5000", "--num-gpu-blocks", "2000")
TOKEN = "prior-classes-token"
# Told, as calibration would find: a change of keys mid-test would forget every prefix.
CONFIG = (
    "parse: {block_tokens: 16, bytes_per_token: 1}\n"
    + f"server: {{explain_tokens: [{TOKEN}]}}\n"
    + default_profile_with({"bounded-sessions-filter": {"uncontinuedPrior": True}})
)
WORDS = ("chart", "tool", "caption", "table", "patch", "axis", "legend", "file", "diff", "row")
# The default floor of bounded-sessions-filter's horizon, and a margin.
FLOOR_S = 2.0 + 0.3
BOUNDED = "default/bounded-sessions-filter"


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def tools(name: str) -> list[dict]:
    """An agent's tool definitions (each agent its own)."""
    return [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}]


def test_a_tools_class_that_came_back_stays_bounded_while_tool_less_one_shots_use_the_prior(
    tmp_path,
):
    rng = random.Random(5)
    cfg = tmp_path / "picker.yaml"
    cfg.write_text(CONFIG)
    opts = StackOptions(
        upstreams=4, sim_args=SIM, extproc_args=("--config", str(cfg)), allow_explain=True
    )
    with Stack(opts) as stack, httpx.Client(timeout=60) as http:

        def send(
            messages: list[dict], tool_defs: list[dict] | None = None, *, compact: bool = False
        ) -> list[str]:
            body: dict = {"model": "tiny", "max_tokens": 2, "messages": messages}
            if tool_defs:
                body["tools"] = tool_defs
            # Compact JSON, for the second agent: tool lists open alike (`{"type":
            # "function", "function": {"name": ...`), so two agents' first 16-byte blocks
            # are the same, and the second would read the first's growth under them, not
            # its class's prior; another client's spacing makes its bytes its own.
            separators = (",", ":") if compact else (", ", ": ")
            r = http.post(
                f"{stack.url}/v1/chat/completions",
                content=json.dumps(body, separators=separators),
                headers={EXPLAIN_HEADER: TOKEN, "content-type": "application/json"},
            )
            assert r.status_code == 200, r.text
            return json.loads(r.headers[DECISION_HEADER])["reasons"]

        def ask(group: str, q: int) -> list[dict]:
            # The group's prompt is the same for every question (its own seed).
            system = f"{group} You describe documents. " + text(random.Random(group), 200)
            return [
                {"role": "system", "content": system},
                {"role": "user", "content": f"question {q}: " + text(rng, 20)},
            ]

        # Eight tool-less prompts asked once each: their class's fates, all uncontinued.
        for g in range(8):
            send(ask(f"{g}{g}{g}", 0))
        # An agent declaring tools comes back for its second turn: its class's fate.
        agent = [
            {"role": "system", "content": "You are a coding agent. " + text(rng, 200)},
            {"role": "user", "content": "task 0: " + text(rng, 30)},
        ]
        send(agent, tools("run_shell"))
        run = {"name": "run_shell", "arguments": json.dumps({"command": "ls"})}
        call = {"id": "call_0", "type": "function", "function": run}
        agent += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": "result " + text(rng, 60)},
        ]
        send(agent, tools("run_shell"))
        time.sleep(FLOOR_S)  # the eight one-shot prompts pass their horizon

        # A new tool-less group: its repeat, within its own first's horizon, is read by the
        # prior of its class (one-shot) and left to the scorers.
        send(ask("new", 0))
        repeat = send(ask("new", 1))
        # A new agent prompt declaring tools: its second session is bounded (its class came
        # back), as without the prior.
        prompt = "You are a review agent. " + text(rng, 200)
        for s in range(2):
            messages = [
                {"role": "system", "content": prompt},
                {"role": "user", "content": f"task {s}: " + text(rng, 30)},
            ]
            second = send(messages, tools("read_file"), compact=True)
        metrics = http.get(f"http://127.0.0.1:{stack.picker_admin_port}/metrics").text
    bound = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("extproc_session_bound_") and "_total{" in line
    }
    assert not [r for r in repeat if r.startswith(BOUNDED)], repeat
    assert bound["extproc_session_bound_uncontinued_prior_total"] == 1, bound
    # The agent's second session: bounded for want of growth (its class comes back).
    assert bound["extproc_session_bound_growth_unknown_total"] == 1, (bound, second)
    assert bound["extproc_session_bound_uncontinued_unclassed_total"] == 0, bound
